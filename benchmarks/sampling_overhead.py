"""Sampling-batch overhead: the per-step cost of preparing a step's sampling inputs, and of the
whole sampling, at 256 running requests, on random logits (no model).

The rows are a mix, a fifth each: greedy; temperature; temperature + top-k + top-p; temperature
with repetition, frequency and presence penalties; seeded temperature + top-p. Prompts are
``--prompt-len`` random tokens; every request has ``--output-len`` tokens already generated when the
measurement starts. Each step samples every row from fresh random logits [256, V] and appends the
sampled tokens, as the scheduler does. Two scenarios:

- ``steady``: the same 256 requests every step (pure decode);
- ``churn``: every step one request leaves and a new one (with a fresh prompt) joins.

Reported per step, the median over ``--steps``: ``prepare`` (what the scheduler does before the
sampler: with issue 28 the persistent ``SamplingState.batch``, before it ``SamplingBatch.build``
with the requests' running SeenTokens and generators), ``update`` (after the sampler: the state's
``advance`` with the sampled tokens, and reading them) and ``total`` (prepare + the sampler +
update). The script runs against either tree (it looks for ``SamplingState``).

    python benchmarks/sampling_overhead.py [--batch 256] [--vocab 49152] [--steps 30]
                                           [--prompt-len 512] [--output-len 64] [--threads N]
                                           [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from engine.sampling import Sampler, SamplingParams
from engine.scheduler.request import Req

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}

MIX = [
    SamplingParams(temperature=0, max_new_tokens=10**6),
    SamplingParams(temperature=0.8, max_new_tokens=10**6),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=10**6),
    SamplingParams(temperature=0.9, repetition_penalty=1.1, frequency_penalty=0.2,
                   presence_penalty=0.1, max_new_tokens=10**6),
    SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_new_tokens=10**6),
]


def make_req(i: int, rng: random.Random, args) -> Req:
    params = MIX[i % len(MIX)]
    if params.seed is not None:
        params = dataclasses.replace(params, seed=params.seed + i)
    prompt = [rng.randrange(3, args.vocab) for _ in range(args.prompt_len)]
    req = Req(f"r{i}", prompt, params)
    req.output_ids = [rng.randrange(3, args.vocab) for _ in range(args.output_len)]
    return req


class Prepare:
    """What the scheduler does before calling the sampler, for whichever API this tree has."""

    def __init__(self, vocab: int, eos: set[int]):
        self.vocab, self.eos = vocab, eos
        try:
            from engine.sampling import SamplingState
        except ImportError:  # the tree before issue 28: a SamplingBatch built every step
            self.state = None
        else:
            self.state = SamplingState(vocab, eos)

    def batch(self, rows: list[Req], device):
        if self.state is not None:
            return self.state.batch(rows, device)
        from engine.sampling import SamplingBatch
        from engine.sampling.penalties import SeenTokens
        from engine.sampling.sampler import make_generator

        for r in rows:
            if r.seen is None and r.params.uses_penalties:
                r.seen = SeenTokens(self.vocab, r.prompt_ids, r.output_ids)
            if r.generator is None and r.params.seed is not None:
                r.generator = make_generator(r.params.seed)
        return SamplingBatch.build([r.params for r in rows], [r.prompt_ids for r in rows],
                                   [r.output_ids for r in rows], [r.generator for r in rows],
                                   self.eos, self.vocab, device=device,
                                   seen=[r.seen for r in rows])

    def advance(self, tokens):
        if self.state is not None:
            self.state.advance(tokens)


def run(args, churn: bool) -> list[float]:
    clock = CLOCKS[args.clock]
    rng = random.Random(0)
    torch.manual_seed(0)
    rows = [make_req(i, rng, args) for i in range(args.batch)]
    next_id = args.batch
    prep = Prepare(args.vocab, {2})
    sampler = Sampler()
    logits_src = torch.randn(args.batch, args.vocab) * 3
    prepare_s, update_s, total_s = [], [], []
    for step in range(args.warmup + args.steps):
        if churn and step > 0:
            rows = rows[1:] + [make_req(next_id, rng, args)]
            next_id += 1
        logits = logits_src.roll(step, dims=1)
        t0 = clock()
        batch = prep.batch(rows, logits.device)
        t1 = clock()
        out = sampler(logits, batch, overwrite=True)
        t2 = clock()
        prep.advance(out.next_token_ids)
        tokens = out.next_token_ids.tolist()
        t3 = clock()
        for r, tok in zip(rows, tokens):
            r.append_token(tok)
        if step >= args.warmup:
            prepare_s.append(t1 - t0)
            update_s.append(t3 - t2)
            total_s.append(t3 - t0)
    return [statistics.median(x) * 1e3 for x in (prepare_s, update_s, total_s)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="cpu: this thread's CPU time (with --threads 1, all of the work; "
                         "steadier than wall time on a shared machine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, vocab {args.vocab}, prompt {args.prompt_len}, output "
          f"{args.output_len}+, torch threads {torch.get_num_threads()}, {args.clock} clock")
    print(f"{'scenario':<8} {'prepare ms':>11} {'update ms':>10} {'total ms':>9}")
    for name, churn in (("steady", False), ("churn", True)):
        prepare, update, total = run(args, churn)
        print(f"{name:<8} {prepare:>11.3f} {update:>10.3f} {total:>9.2f}")


if __name__ == "__main__":
    main()
