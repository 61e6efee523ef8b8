"""Eager vs ``--enable-torch-compile``: decode step time per batch size, and one prompt chunk.

For each batch size B: B requests with 64-token prompts are prefilled, then decode steps are
timed (every row one token, so a step is one forward of B tokens plus sampling). The same runs
with the eager engine (oneDNN-prepacked linears) and the compiled one; compile time is printed.

    python benchmarks/torch_compile.py [--model default|PATH] [--batch-sizes 1,4,16,32]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import bench_models  # noqa: E402


def decode_ms(engine, batch: int, steps: int, seed: int = 0, prompt_len: int = 64) -> float:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 30000) for _ in range(prompt_len)] for _ in range(batch)]
    params = {"max_new_tokens": steps + 8, "ignore_eos": True, "temperature": 0.0}
    reqs = [r for p in prompts for r in engine.add_request(p, params)]
    while any(r.prefilling or not r.output_ids for r in reqs):
        engine.step()
    engine.step()  # warm
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - start) / steps * 1e3
    for r in reqs:
        engine.abort(r)
    return ms


def prefill_ms(engine, tokens: int, seed: int = 1) -> float:
    rng = random.Random(seed)
    params = {"max_new_tokens": 1, "ignore_eos": True}
    best = float("inf")
    for _ in range(3):
        prompt = [rng.randrange(100, 30000) for _ in range(tokens)]
        (req,) = engine.add_request(prompt, params)
        start = time.perf_counter()
        while not req.finished:
            engine.step()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default",
                    help="'default' (SmolLM2-135M-Instruct) or a path")
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prefill-tokens", type=int, default=32,
                    help="a prompt of this many tokens (within --torch-compile-max-bs)")
    args = ap.parse_args()
    from engine import Engine

    path = bench_models.resolve(args.model, None)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_bs = max(max(sizes), args.prefill_tokens)
    common = dict(max_total_tokens=32768, disable_radix_cache=True)
    results = {}
    for label, extra in (("eager", {}), ("compiled", {"enable_torch_compile": True,
                                                      "torch_compile_max_bs": max_bs})):
        start = time.perf_counter()
        engine = Engine(path, **common, **extra)
        load = time.perf_counter() - start
        results[label] = {b: decode_ms(engine, b, args.steps) for b in sizes}
        results[label]["prefill"] = prefill_ms(engine, args.prefill_tokens)
        print(f"{label}: engine ready in {load:.1f} s"
              + (" (includes the compile)" if extra else ""))
        del engine
    print(f"\n{bench_models.name(args.model, path)}, {os.cpu_count()} CPU threads, float32; "
          f"ms per decode step (B rows), and a {args.prefill_tokens}-token prompt")
    print(f"{'':>12s} {'eager':>9s} {'compiled':>9s} {'compiled/eager':>15s}")
    for key in [*sizes, "prefill"]:
        e, c = results["eager"][key], results["compiled"][key]
        name = f"B={key}" if key != "prefill" else f"prefill {args.prefill_tokens}"
        print(f"{name:>12s} {e:9.1f} {c:9.1f} {c / e:14.2f}x")


if __name__ == "__main__":
    main()
