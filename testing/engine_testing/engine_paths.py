"""A model family's greedy tokens on the engine's whole path equal to HF transformers': through
chunked prefill, radix-cache hits and retraction, the scheduler's slots all free after (what
tests/test_moe_engine.py and tests/test_deepseek_engine.py check of their tiny checkpoints)."""

from __future__ import annotations

import functools
import logging
import random

import torch

from engine_testing.invariants import assert_all_free

GREEDY = {"temperature": 0, "ignore_eos": True}


def ids(seed: int, n: int) -> list[int]:
    """``n`` token ids in [3, 500), the same for the same ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


# two pairs of prompts sharing a 40-token prefix (radix hits), chunked at 16 tokens
SYSTEM = ids(99, 40)
PROMPTS = [SYSTEM + ids(1, 9), SYSTEM + ids(2, 3), ids(3, 30), ids(4, 5), SYSTEM + ids(5, 17)]


@functools.cache
def hf_greedy(model_dir: str, new_tokens: int) -> tuple:
    """HF transformers' greedy ``new_tokens`` after each of PROMPTS (float32, eager attention,
    EOS ignored)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    outs = []
    for p in PROMPTS:  # one at a time: no padding on the HF side
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=2)
        outs.append(out[0, len(p):].tolist())
    return tuple(outs)


def run_greedy(engine, prompts, new_tokens: int) -> tuple[list[list[int]], list]:
    """``engine.generate``'s greedy ``new_tokens`` (EOS ignored) after each prompt: the output
    ids, and the outputs themselves."""
    outs = engine.generate(input_ids=prompts,
                           sampling_params={**GREEDY, "max_new_tokens": new_tokens})
    return [o["output_ids"] for o in outs], outs


def check_chunked_prefill_and_radix_hits(engine, model_dir: str, new_tokens: int) -> None:
    """``engine`` (chunked at 16 tokens) gives HF's tokens for PROMPTS: the first alone, then
    the rest (two of them hit its prefix in the radix cache), then all again (all cached)."""
    expected = list(hf_greedy(model_dir, new_tokens))
    first, _ = run_greedy(engine, PROMPTS[:1], new_tokens)  # its prefix is then cached
    rest, outs = run_greedy(engine, PROMPTS[1:], new_tokens)
    assert first + rest == expected
    assert outs[0]["meta_info"]["cached_tokens"] >= len(SYSTEM)
    assert outs[3]["meta_info"]["cached_tokens"] >= len(SYSTEM)
    again, outs = run_greedy(engine, PROMPTS, new_tokens)  # everything cached now
    assert again == expected and all(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    assert_all_free(engine)


def check_retraction(model_dir: str, new_tokens: int, caplog) -> None:
    """An engine too small for PROMPTS' decodes retracts requests and still gives HF's
    tokens (``caplog``: pytest's fixture, for the warning)."""
    from engine import Engine

    small = Engine(model_dir, max_total_tokens=150, schedule_conservativeness=0.1,
                   chunked_prefill_size=32)
    with caplog.at_level(logging.WARNING, logger="engine"):
        outs, _ = run_greedy(small, PROMPTS, new_tokens)
    assert any("decode out of memory" in r.getMessage() for r in caplog.records)
    assert small.scheduler.counters.retracted_reqs >= 1
    assert outs == list(hf_greedy(model_dir, new_tokens))
    assert_all_free(small)
