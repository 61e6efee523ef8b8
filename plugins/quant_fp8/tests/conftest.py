"""Fixtures: FP8 runners and teacher-forced logits over a fixed prompt set (the tiny-model
fixtures come from the repository's root conftest.py)."""

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
def make_runner(registries, cpu_device):
    """``make(path, quantization=None, kv="auto", dtype="float32", tokens=2048)``: a
    ModelRunner with its KV pool."""
    from engine.runner import ModelRunner

    def make(path, quantization=None, kv="auto", dtype="float32", tokens=2048):
        method = registries.quantization.get(quantization).obj if quantization else None
        runner = ModelRunner(path, registries=registries, device=cpu_device, dtype=dtype,
                             kv_dtype=registries.kv_dtypes.get(kv).obj, quant_method=method)
        runner.init_kv_pool(tokens)
        return runner

    return make


def teacher_forced_logits(runner, prompts: list[list[int]]) -> torch.Tensor:
    """float32 logits [prompts, PROMPT_LEN - 1, V] predicting each next prompt token."""
    from engine.forward_batch import ForwardBatch
    from engine.testing import free_requests

    pool = runner.kv_pool
    rows = [pool.alloc_req() for _ in prompts]
    steps = [[p[:PREFILL] for p in prompts]] + [[[p[i]] for p in prompts]
                                                for i in range(PREFILL, PROMPT_LEN - 1)]
    out, done = [], 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # also in module fixtures, which run before single_torch_thread
    try:
        for new in steps:
            n = len(new[0])
            locs = torch.cat([pool.extend_slots(r, done, n) for r in rows])
            batch = ForwardBatch.build(new, [done] * len(rows), rows, locs, pool.req_to_token)
            out.append(runner.forward(batch, return_all_logits=True).view(len(rows), n, -1))
            done += n
    finally:
        torch.set_num_threads(threads)
    free_requests(pool, rows, [done] * len(rows))
    return torch.cat(out, dim=1)


@pytest.fixture(scope="session")
def forced():
    return teacher_forced_logits
