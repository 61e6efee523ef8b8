"""Prefix-cache benchmark: 90% of each prompt is one of a few shared system prompts.

Runs the same workload three ways in one process: lpm with the radix cache, fcfs with the cache,
and the cache disabled; prints output tokens/s and the ratios against the cache-disabled run.

    python benchmarks/prefix_cache.py [--requests 64] [--system-prompts 4] [--model default]
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time

import torch
from bench_models import add_model_option, resolve
from bench_models import name as model_name

from engine import Engine
from engine_testing.checkpoints import make_tiny_model


def workload(n_requests: int, n_systems: int, prompt_len: int, output_len: int, seed: int = 0):
    rng = random.Random(seed)
    shared = int(prompt_len * 0.9)
    systems = [[rng.randrange(3, 500) for _ in range(shared)] for _ in range(n_systems)]
    prompts = [systems[i % n_systems] + [rng.randrange(3, 500) for _ in range(prompt_len - shared)]
               for i in range(n_requests)]  # arrivals interleave the system prompts
    return prompts, {"temperature": 0, "ignore_eos": True, "max_new_tokens": output_len}


def run(model_dir, prompts, params, repeats, **engine_kwargs):
    """Best of ``repeats`` runs, each from a cold (flushed) cache."""
    engine = Engine(model_dir, **engine_kwargs)
    elapsed = float("inf")
    for _ in range(repeats):
        engine.flush_cache()
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = min(elapsed, time.perf_counter() - start)
    tokens = sum(len(o["output_ids"]) for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    return tokens / elapsed, elapsed, cached, [o["output_ids"] for o in outs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=12000)
    ap.add_argument("--repeats", type=int, default=3, help="best of N runs per configuration")
    add_model_option(ap, "a 4-layer 256-wide Llama")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = resolve(args.model, lambda: make_tiny_model(
            tmp, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024))
        prompts, params = workload(args.requests, args.system_prompts, args.prompt_len,
                                   args.output_len)
        common = {"max_total_tokens": args.max_total_tokens, "repeats": args.repeats}
        run(model_dir, prompts[:8], params, **common)  # warm-up: first-touch allocations
        runs = {
            "lpm + radix cache": run(model_dir, prompts, params, schedule_policy="lpm", **common),
            "fcfs + radix cache": run(model_dir, prompts, params, schedule_policy="fcfs", **common),
            "cache disabled": run(model_dir, prompts, params, disable_radix_cache=True, **common),
        }
    base = runs["cache disabled"][0]
    print(f"model: {model_name(args.model, model_dir)}; "
          f"{args.requests} requests, prompt {args.prompt_len} tokens (90% shared among "
          f"{args.system_prompts} system prompts), {args.output_len} output tokens each, "
          f"{torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'run':<20} {'output tok/s':>12} {'seconds':>8} {'cached tokens':>14} {'vs disabled':>12}")
    for name, (tps, secs, cached, _) in runs.items():
        print(f"{name:<20} {tps:>12.1f} {secs:>8.2f} {cached:>14} {tps / base:>11.2f}x")
    same = len({tuple(map(tuple, r[3])) for r in runs.values()}) == 1
    print(f"identical outputs across the three runs: {same}")


if __name__ == "__main__":
    main()
