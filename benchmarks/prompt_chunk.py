"""A prompt chunk on this machine: the step that prefills ``--prompts`` prompts of
``--prompt-len`` tokens at once (eager: more tokens than the CPU graph replays), as a server's
first step after a burst of requests.

Starts an offline Engine on the default model (or ``--model``), then ``--repeats`` times adds
the prompts (different tokens each time: no prefix-cache hits) with one new token each and
times the step that prefills them; prints the median and, with ``--profile``, torch.profiler's
table of the torch ops (the C kernels' time is what the table does not show). Extra engine
options as ``key=value`` after ``--``.

    python benchmarks/prompt_chunk.py [--model PATH] [--prompts 4] [--prompt-len 128]
        [--compare] [--profile] [-- dtype=float16]

``--compare`` alternates, chunk by chunk in the same engine (the machine's drift hits all
alike), the paths before and after the fused C loops and the cpu backend's prompt kernel:
RMSNorm, SiLU-and-mul and rotary as torch ops (ENGINE_NORM_KERNEL=torch) with the prompt
attention through torch SDPA (ENGINE_PROMPT_ATTENTION=sdpa); the fused loops with SDPA; both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from batch1_step import open_engine, profile_and_options


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="[default: the default model]")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--compare", action="store_true",
                    help="alternate torch ops + SDPA, fused loops + SDPA, fused + the kernel")
    profile_and_options(ap, rows=20)
    args = ap.parse_args(argv)
    engine = open_engine(args)
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}

    def chunk(seed: int) -> float:
        for r in range(args.prompts):
            engine.add_request([(7 * i + 13 * r + 101 * seed) % 5000 + 100
                                for i in range(args.prompt_len)], params)
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    for seed in range(3):  # warm-up
        chunk(seed)
    backend = engine.runner.backend
    paths = {"": None}
    if args.compare:
        if not hasattr(backend, "prompt_kernel"):
            raise SystemExit(f"--compare needs the cpu attention backend, found "
                             f"{type(backend).__name__}")
        paths = {"torch ops + SDPA": ("torch", False), "fused loops + SDPA": ("auto", False),
                 "fused loops + prompt kernel": ("auto", True)}
    times = {name: [] for name in paths}
    for i in range(args.repeats):
        for j, (name, setting) in enumerate(paths.items()):
            if setting is not None:
                os.environ["ENGINE_NORM_KERNEL"], backend.prompt_kernel = setting
            times[name].append(chunk(10 + i * len(paths) + j))
    for name, t in times.items():
        print(f"prompt chunk, {args.prompts} x {args.prompt_len} tokens{', ' if name else ''}"
              f"{name}: median {statistics.median(t) * 1e3:.1f} ms (min {min(t) * 1e3:.1f}, "
              f"max {max(t) * 1e3:.1f}) over {len(t)} chunks")
    if not args.profile:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(3):
            chunk(100 + i)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
