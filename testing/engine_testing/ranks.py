"""Test helpers for model-level parallel tests: spawned gloo ranks that each put one result
on a queue (bounded: a rank that errs, dies or overruns fails the test, never hangs), the cases'
inputs, and the whole model's HF reference."""

from __future__ import annotations

import queue
import time

import torch


def run_spawned_ranks(target, world: int, args: tuple, label: str, timeout_s: float) -> dict:
    """Start ``target(rank, port, *args, results)`` in ``world`` spawned processes; returns
    rank -> what it put on ``results`` (``(rank, out)``; a str ``out`` is a traceback)."""
    import pytest

    from engine.net import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, out = results.get(timeout=1)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    pytest.fail(f"a {label} rank died (exit code {dead[0]}) without a result")
                if time.monotonic() > deadline:
                    pytest.fail(f"{label} ranks gave no result in {timeout_s}s")
                continue
            if isinstance(out, str):
                pytest.fail(f"{label} rank {rank} failed:\n{out}")
            got[rank] = out
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0, f"a {label} rank exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return got


def case_inputs(cases: dict, texts: list[str], tiny_model_factory, tiny_gguf_factory):
    """(HF directory, prompts as ids, the path the ranks read: the GGUF file where the case
    says so) per case; ``cases``: name -> (architecture, config overrides, read a GGUF)."""
    from transformers import AutoTokenizer

    paths = {case: tiny_model_factory(arch, **kw) for case, (arch, kw, _) in cases.items()}
    prompts = {case: [AutoTokenizer.from_pretrained(p)(t).input_ids for t in texts]
               for case, p in paths.items()}
    read = {case: tiny_gguf_factory(arch, "F32", **kw) if gguf else paths[case]
            for case, (arch, kw, gguf) in cases.items()}
    return paths, prompts, read


def hf_reference(path: str, prompts: list[list[int]], new_tokens: int):
    """(HF model, its prompt logits concatenated, its greedy tokens) in float32."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
        tokens = [hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=2, eos_token_id=None)[0, len(p):].tolist()
                  for p in prompts]
    return hf, logits, tokens
