"""Fixtures: a fixed prompt set, teacher-forced logits over it, and how far logits are from a
reference's (the tiny-model fixtures and ``make_runner`` come from the repository's root
conftest.py)."""

from __future__ import annotations

import pytest
import torch

# 8 prompts of 48 random ids: the first PREFILL tokens go in one extend step, the rest one
# token per decode step, so both attention paths read the (maybe fp8) KV pool
NUM_PROMPTS, PROMPT_LEN, PREFILL = 8, 48, 16


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, 512, (PROMPT_LEN,), generator=gen).tolist()
            for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="session")
def forced():
    from engine_testing.logits import teacher_forced_logits

    return lambda runner, prompts: teacher_forced_logits(runner, prompts, PREFILL)


@pytest.fixture(scope="session")
def logit_error():
    """``(got, ref) -> (rel_rms, max_err)``: the RMS of ``got - ref`` over the RMS of ``ref``'s
    spread around each position's mean (a shift that softmax ignores), and the largest
    ``|got - ref|`` in units of ``ref``'s standard deviation."""
    def measure(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
        diff = got - ref
        spread = ref - ref.mean(-1, keepdim=True)
        return (diff.norm() / spread.norm()).item(), (diff.abs().max() / ref.std()).item()

    return measure
