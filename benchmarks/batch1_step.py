"""Batch-1 decode: where one step of one request goes (a person chatting).

Starts an offline Engine on the default model (or ``--model``), runs one request of
``--prompt-len`` prompt tokens and ``--output-len`` greedy new tokens, and prints the median
wall time of a decode step (``engine.step()``), then a torch.profiler table of the steps: the
time in linear kernels (the GEMMs) against everything else (norms, rope, attention, sampling,
the scheduler's Python). Extra engine options as ``key=value`` after ``--``.

    python benchmarks/batch1_step.py [--model PATH] [--steps 64] [--profile] [-- dtype=float16]

Compare kernels with ENGINE_LINEAR_KERNEL=torch (the core's oneDNN path over the float32
weights the GGUF was dequantized to) against the default (block kernels where they run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse_options(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        out[key.replace("-", "_")] = value
    return out


def profile_and_options(ap: argparse.ArgumentParser, rows: int) -> None:
    """The options this benchmark and prompt_chunk.py share: the profiler's, the engine's."""
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's table")
    ap.add_argument("--rows", type=int, default=rows, help="rows of the profiler table")
    ap.add_argument("options", nargs="*", help="engine options key=value")


def open_engine(args):
    """An offline Engine on ``args.model`` (default: the default model) with ``args.options``;
    prints its linear kernels."""
    from engine import Engine
    from engine.models.default import default_model_path

    engine = Engine(args.model or default_model_path(), **parse_options(args.options))
    print(engine.runner.linear_kernel)
    return engine


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="[default: the default model]")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    profile_and_options(ap, rows=25)
    args = ap.parse_args(argv)
    engine = open_engine(args)
    print(f"torch threads: {torch.get_num_threads()}")
    ids = [(7 * i + 3) % 1000 + 100 for i in range(args.prompt_len)]
    params = {"temperature": 0, "max_new_tokens": args.steps + 16, "ignore_eos": True}
    engine.add_request(ids, params)
    for _ in range(4):  # prefill and warm-up decodes
        engine.step()
    times = []
    for _ in range(args.steps // 2):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"decode step, batch 1: median {statistics.median(times) * 1e3:.2f} ms "
          f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}) over {len(times)} steps")
    if not args.profile:
        return
    from torch.profiler import ProfilerActivity, profile

    n = args.steps - args.steps // 2
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            engine.step()
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    total = sum(e.self_cpu_time_total for e in events) / n / 1e3
    linear = sum(e.self_cpu_time_total for e in events
                 if "linear" in e.key.lower() or "mm" == e.key.split("::")[-1]) / n / 1e3
    print(f"per step: {total:.2f} ms in torch ops, of which {linear:.2f} ms in linear kernels")


if __name__ == "__main__":
    main()
