"""Scheduler overhead: the step time spent outside the model forward, at 256/64/16 running requests.

Per decode step it times the whole ``Engine.step``, the ``runner.forward`` inside it and the
sampler inside it (both wrapped with a timer); the scheduler's overhead is the step minus the
forward (sampling included: it runs on the same cores between two forwards). 256 requests are
prefilled once per mode and decode with EOS ignored; after the 256-request measurement all but 64
are aborted, then all but 16, so every measurement is a full batch of pure decode steps.
Modes: greedy, and greedy with repetition, frequency and presence penalties.

    python benchmarks/scheduler_overhead.py [--model default] [--sizes 256,64,16] [--steps 10]
                                            [--prompt-len 128] [--profile]

``--model``: ``random`` (a random 4-layer 256-wide Llama, the default), ``default``
(SmolLM2-135M-Instruct) or a path. ``--profile`` prints cProfile's top functions over the
measured steps at the largest size.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import random
import tempfile
import time

import torch
from bench_models import add_model_option, resolve
from bench_models import name as model_name

from engine import Engine
from engine.testing import make_tiny_model

MODES = {
    "greedy": {"temperature": 0},
    "penalties": {"temperature": 0, "repetition_penalty": 1.1, "frequency_penalty": 0.2,
                  "presence_penalty": 0.1},
}
CHUNK = 4096  # prompt tokens per prefill step while filling the batch


class Timer:
    """Wraps a callable and adds the seconds spent in it to ``total``."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - start


def fill(engine, n, prompt_len, vocab, params, seed):
    """Queue ``n`` requests and step until every one is decoding."""
    rng = random.Random(seed)
    reqs = [engine.add_request([rng.randrange(3, vocab) for _ in range(prompt_len)], params)[0]
            for _ in range(n)]
    s = engine.scheduler
    while s.waiting or any(r.prefilling for r in s.running):
        engine.step()
    assert len(s.running) == n, (len(s.running), n)
    return reqs


def measure(engine, steps, warmup, profile):
    """Per-step (step, forward, sample) milliseconds over ``steps`` decode steps."""
    s = engine.scheduler
    n = len(s.running)
    for _ in range(warmup):
        engine.step()
    forward, sample = engine.runner.forward, s.sampler
    f0, s0 = forward.total, sample.total
    prof = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(steps):
        engine.step()
    if prof:
        prof.disable()
    total = time.perf_counter() - start
    assert len(s.running) == n, "a request finished during the measurement: raise max_new_tokens"
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return [1000 * x / steps for x in (total, forward.total - f0, sample.total - s0)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,64,16", help="running requests, largest first")
    ap.add_argument("--steps", type=int, default=10, help="measured decode steps per size")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured decode steps per size")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--profile", action="store_true")
    add_model_option(ap, "a 4-layer 256-wide Llama")
    args = ap.parse_args()
    sizes = sorted((int(x) for x in args.sizes.split(",")), reverse=True)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    # every request stays running: the first admitted decode while the last ones prefill
    fill_steps = -(-sizes[0] * args.prompt_len // CHUNK)
    max_new = fill_steps + len(sizes) * (args.warmup + args.steps) + 8
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = resolve(args.model, lambda: make_tiny_model(
            tmp, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024))
        engine = Engine(model_dir, max_running_requests=sizes[0], chunked_prefill_size=CHUNK,
                        max_total_tokens=int(1.2 * sizes[0] * (args.prompt_len + max_new)),
                        schedule_conservativeness=0.1)
        engine.runner.forward = Timer(engine.runner.forward)
        engine.scheduler.sampler = Timer(engine.scheduler.sampler)
        vocab = engine.runner.model_config.vocab_size
        print(f"model: {model_name(args.model, model_dir)}; prompt {args.prompt_len} tokens, "
              f"{args.steps} decode steps per size after {args.warmup} warm-up, "
              f"{torch.get_num_threads()} threads")
        print(f"{'mode':<10} {'running':>7} {'step ms':>9} {'forward ms':>10} "
              f"{'sample ms':>9} {'sched ms':>9} {'sched %':>8}")
        for i, mode in enumerate(args.modes.split(",")):
            params = {**MODES[mode], "ignore_eos": True, "max_new_tokens": max_new}
            reqs = fill(engine, sizes[0], args.prompt_len, vocab, params, seed=i)
            for size in sizes:
                for r in reqs[size:]:
                    engine.abort(r)
                reqs = reqs[:size]
                step, fwd, smp = measure(engine, args.steps, args.warmup,
                                         args.profile and size == sizes[0])
                sched = step - fwd
                print(f"{mode:<10} {size:>7} {step:>9.1f} {fwd:>10.1f} {smp:>9.1f} "
                      f"{sched:>9.1f} {100 * sched / step:>7.1f}%", flush=True)
            for r in reqs:
                engine.abort(r)
            engine.scheduler.check_invariants()


if __name__ == "__main__":
    main()
