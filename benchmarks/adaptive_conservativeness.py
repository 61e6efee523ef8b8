"""--schedule-conservativeness 1.0 vs 0.3 vs auto on an early-EOS workload.

The guide's "too conservative" case: every request asks for a large max_new_tokens but stops
early (here: greedy decoding that stops at the first token of a fixed random stop set, the
stand-in for EOS with random weights, so most outputs are a few dozen tokens and a few run
long). Each setting serves the same requests on the same pool; printed per setting: mean token
usage over the steps with requests waiting (the guide's "token usage < 0.9 with #queue-req > 0"),
that mean in each quarter of those steps (the first quarter holds the start, when the pool fills
and ``auto`` has seen nothing finish; the last ones are its steady state),
generation throughput (each setting runs twice and the second run counts), steps and tokens
per step (the throughput a busy shared machine cannot blur: every step is one forward),
retractions, and the ratios against 1.0. Outputs must be identical
(admission order does not change greedy tokens); the script checks it.

    python benchmarks/adaptive_conservativeness.py [--model random] [--requests 600]
        [--max-new-tokens 256] [--max-total-tokens 4096] [--stop-ids 24] [--full-length]

``--full-length`` ignores the stop set (every request runs to max_new_tokens): ``auto`` should
then reserve like 1.0 at first and, once it has seen requests run to the end, all of their
max_new_tokens, without a retraction storm.
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time

from bench_models import add_model_option, resolve
from bench_models import name as model_name

from engine import Engine
from engine.testing import make_tiny_model

SETTINGS = (1.0, 0.3, "auto")


def workload(n: int, vocab: int, stop_ids: int, max_new: int, full_length: bool, seed: int = 0):
    rng = random.Random(seed)
    stops = rng.sample(range(3, vocab), stop_ids)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 48))] for _ in range(n)]
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new,
              "stop_token_ids": [] if full_length else stops}
    return prompts, params


def serve(path: str, conservativeness, prompts, params, max_total_tokens: int) -> dict:
    engine = Engine(path, max_total_tokens=max_total_tokens,
                    schedule_conservativeness=conservativeness)
    usages = []
    observe = engine.scheduler.on_step

    def on_step(stats):
        if stats.num_queue_reqs > 0 and stats.forward_mode != "idle":
            usages.append(stats.token_usage)
        if observe:
            observe(stats)

    engine.scheduler.on_step = on_step
    start = time.perf_counter()
    reqs = [engine.add_request(p, params)[0] for p in prompts]
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    generated = sum(len(r.output_ids) for r in reqs)
    quarters = [usages[len(usages) * q // 4: len(usages) * (q + 1) // 4] for q in range(4)]
    return {"usage": sum(usages) / len(usages) if usages else 0.0, "tok_s": generated / seconds,
            "quarters": [sum(u) / len(u) if u else 0.0 for u in quarters],
            "steps": steps, "retracted": engine.scheduler.counters.retracted_reqs,
            "generated": generated, "outputs": [r.output_ids for r in reqs],
            "ratio": engine.scheduler.ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_option(ap, "a random 4-layer 256-wide Llama")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--stop-ids", type=int, default=24, help="size of the random stop set")
    ap.add_argument("--full-length", action="store_true", help="no stop set: run to the end")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    path = resolve(args.model, lambda: make_tiny_model(
        tempfile.mkdtemp(), "LlamaForCausalLM", hidden_size=256, intermediate_size=512,
        num_hidden_layers=4))
    engine_vocab = 500  # below every model's vocabulary, above the special ids
    prompts, params = workload(args.requests, engine_vocab, args.stop_ids, args.max_new_tokens,
                               args.full_length)
    stops = "no stop set" if args.full_length else f"a stop set of {args.stop_ids} ids"
    print(f"model: {model_name(args.model, path)}; {args.requests} requests, max_new_tokens "
          f"{args.max_new_tokens}, {stops}, --max-total-tokens {args.max_total_tokens}")
    # each setting twice, the second reported: a first run pays for every batch shape it is the
    # first to use (oneDNN builds a kernel per shape), which would favour whichever runs later
    results = {c: [serve(path, c, prompts, params, args.max_total_tokens) for _ in range(2)][-1]
               for c in SETTINGS}
    base = results[1.0]
    lengths = sorted(len(o) for o in base["outputs"])
    print(f"output tokens: median {lengths[len(lengths) // 2]}, max {lengths[-1]}, "
          f"mean {sum(lengths) / len(lengths):.1f}")
    print(f"{'conservativeness':>16} {'token usage (queue>0)':>22} {'gen tok/s':>10} "
          f"{'steps':>6} {'tok/step':>8} {'retracted':>9} {'usage x':>8} {'tok/s x':>8} "
          f"{'tok/step x':>10}")
    for c, r in results.items():
        per_step = r["generated"] / r["steps"]
        print(f"{c!s:>16} {r['usage']:>22.3f} {r['tok_s']:>10.1f} {r['steps']:>6} "
              f"{per_step:>8.2f} {r['retracted']:>9} {r['usage'] / max(base['usage'], 1e-9):>8.2f} "
              f"{r['tok_s'] / base['tok_s']:>8.2f} "
              f"{per_step / (base['generated'] / base['steps']):>10.2f}")
    print("token usage (queue>0) by quarter of those steps:")
    for c, r in results.items():
        print(f"{c!s:>16} " + " ".join(f"{u:.3f}" for u in r["quarters"]))
    print(results["auto"]["ratio"].describe())
    same = all(r["outputs"] == base["outputs"] for r in results.values())
    print(f"outputs identical across settings: {same}")
    if not same:
        raise SystemExit("outputs differ between settings: admission changed tokens")


if __name__ == "__main__":
    main()
