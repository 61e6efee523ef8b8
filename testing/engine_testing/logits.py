"""Logits compared: ours against a reference within a tolerance relative to the logit scale,
every prompt token's against an HF model's, and teacher-forced logits through prefill and
decode steps (both attention paths read the KV pool)."""

from __future__ import annotations

import torch

from engine.quality import prefill_logits
from engine_testing.generation import free_requests


def hf_reference(path: str):
    """The HF causal LM of checkpoint ``path`` as the references here run it: float32, eager
    attention, eval mode, no EOS stop in ``generate``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model


def float32_runner(path: str, registries, device, tokens: int = 1024):
    """A float32 ModelRunner of ``path`` with a KV pool of ``tokens`` slots."""
    from engine.runner import ModelRunner

    runner = ModelRunner(path, registries=registries, device=device, dtype="float32")
    runner.init_kv_pool(tokens)
    return runner


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """max |ours - ref| <= tol * max(1, max |ref|): a tolerance relative to the logit scale."""
    diff = (ours - ref).abs().max().item()
    assert diff <= tol * max(1.0, ref.abs().max().item()), diff


def compare_prompt_logits(runner, reference, prompts: list[list[int]], tol: float) -> None:
    """Every prompt token's logits from one extend batch of ``prompts`` equal, within ``tol``
    (``assert_close_logits``), those of ``reference`` (an HF causal LM) run on each prompt."""
    every = prefill_logits(runner, prompts, return_all_logits=True)
    start = 0
    with torch.no_grad():
        for p in prompts:
            assert_close_logits(every[start:start + len(p)],
                                reference(torch.tensor([p])).logits[0], tol)
            start += len(p)


def teacher_forced_logits(runner, prompts: list[list[int]], prefill: int) -> torch.Tensor:
    """float32 logits [prompts, len - 1, V] predicting each next prompt token: the first
    ``prefill`` tokens of every prompt in one extend step, then one token per decode step, so
    both attention paths read the KV pool. The prompts share one length. Runs on one thread."""
    from engine.forward_batch import ForwardBatch

    length = len(prompts[0])
    pool = runner.kv_pool
    rows = [pool.alloc_req() for _ in prompts]
    steps = [[p[:prefill] for p in prompts]] + [[[p[i]] for p in prompts]
                                                for i in range(prefill, length - 1)]
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
