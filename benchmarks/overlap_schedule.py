"""The overlap scheduler (--enable-overlap-schedule) on vs off: step time and throughput.

The same offline workload (random prompts, greedy with penalties so that the scheduler and the
sampler have real work, output lengths spread so that requests finish mid-batch and new ones
are admitted) runs on one engine per setting; each setting runs the workload twice and the
second run counts. Printed per setting: steps, mean step time, the share of it spent in the
model forward, output throughput, and the ratio against off. Outputs must be identical; the
script checks it. On a CPU the model-worker thread and the scheduler thread share the same
cores, so what overlap can hide is only the scheduler's own Python time, and only where torch
leaves a core idle.

    python benchmarks/overlap_schedule.py [--model random] [--requests 64] [--batch 32]
        [--prompt-len 64] [--max-new-tokens 64] [--threads N]
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
from scheduler_overhead import Timer

from engine import Engine
from engine_testing.checkpoints import make_tiny_model


def workload(n: int, vocab: int, prompt_len: int, max_new: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(prompt_len // 2, prompt_len))]
               for _ in range(n)]
    params = [{"temperature": 0, "ignore_eos": True, "repetition_penalty": 1.1,
               "frequency_penalty": 0.2, "max_new_tokens": rng.randint(max_new // 4, max_new)}
              for _ in range(n)]
    return prompts, params


def run(engine, prompts, params) -> tuple[list, dict]:
    s = engine.scheduler
    step0, forward0 = s.step_no, engine.runner.forward.total
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    steps = s.step_no - step0
    tokens = sum(len(o["output_ids"]) for o in outs)
    return [o["output_ids"] for o in outs], {
        "steps": steps, "step_ms": 1000 * seconds / steps, "tok_s": tokens / seconds,
        "forward_pct": 100 * (engine.runner.forward.total - forward0) / seconds}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="--max-running-requests")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_model_option(ap, "a 4-layer 256-wide Llama")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = resolve(args.model, lambda: make_tiny_model(
            tmp, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024))
        results, reference = {}, None
        for overlap in (False, True):
            engine = Engine(model_dir, max_running_requests=args.batch, max_total_tokens=16384,
                            enable_overlap_schedule=overlap)
            engine.runner.forward = Timer(engine.runner.forward)
            vocab = engine.runner.model_config.vocab_size
            prompts, params = workload(args.requests, vocab, args.prompt_len,
                                       args.max_new_tokens)
            run(engine, prompts, params)  # warm-up
            outs, results[overlap] = run(engine, prompts, params)
            engine.close()
            if reference is None:
                reference = outs
            assert outs == reference, "overlap changed the outputs"
        print(f"model: {model_name(args.model, model_dir)}; {args.requests} requests, "
              f"prompts {args.prompt_len // 2}-{args.prompt_len} tokens, "
              f"{args.max_new_tokens // 4}-{args.max_new_tokens} new, batch <= {args.batch}, "
              f"{torch.get_num_threads()} torch threads; outputs identical")
        print(f"{'overlap':<8} {'steps':>6} {'step ms':>8} {'forward %':>9} {'tok/s':>8} "
              f"{'vs off':>7}")
        for overlap, r in results.items():
            print(f"{'on' if overlap else 'off':<8} {r['steps']:>6} {r['step_ms']:>8.2f} "
                  f"{r['forward_pct']:>8.1f}% {r['tok_s']:>8.1f} "
                  f"{r['tok_s'] / results[False]['tok_s']:>6.2f}x")


if __name__ == "__main__":
    main()
