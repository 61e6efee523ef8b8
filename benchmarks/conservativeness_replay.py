"""--schedule-conservativeness settings on the real model's output lengths, without its time.

The real model's greedy outputs are fixed, so which requests run when depends only on their
lengths and the admission logic. This script records, once, the default model's (SmolLM2)
output lengths for a workload of ``adaptive_conservativeness.py`` (``--record``: one run with a
pool big enough that nothing waits), then replays them through the real scheduler on a 1-layer
random model whose sampled token is replaced by EOS at each request's recorded length (and by
a plain token before it). Prompts are the real ones (ids folded into the tiny vocabulary, so
shared prefixes stay shared in the radix cache). Steps, tokens per step, token usage with a
queue and retractions come out as on the real model (1.0 on fruits: 2266 steps and 8
retractions both ways); wall time does not.

Tokens per step is the throughput where a step costs the same whatever it holds (a GPU's small
batches). On a CPU it does not: a decode row and a prompt token each cost about as much as the
fixed part of a step, so running two more rows gains little and a retraction's recompute (the
victim's prompt and output run again as prompt tokens) costs a lot. ``cpu time`` prices each
replayed step as the real model's steps cost on this machine: FIXED + ROW x decoded rows +
PROMPT x prompt tokens (``--step-cost FIXED,ROW,PROMPT`` in ms, or ``--calibrate``: measured
on the default model here, ~1 minute, and printed for the next ``--step-cost``), and ``cpu x``
is the first setting's time over each one's (above 1: faster).

    python benchmarks/conservativeness_replay.py --record [--workload fruits] [--requests 120]
    python benchmarks/conservativeness_replay.py --calibrate
    python benchmarks/conservativeness_replay.py [--workload fruits|early-eos|full-length|shift]
        [--max-total-tokens 4000] [--settings 1.0,0.3,auto] [--orders 5]

One replay is one trajectory of a chaotic system: 1.0 against 0.95 or 1.05 moves tokens per
step by up to 5-10% on the same lengths. ``--orders K`` replays K orders of the same requests
(order 0 as recorded; the others shuffle requests within blocks of ORDER_BLOCK arrivals, so
that the workload's drift, e.g. fruits' k growing, stays) and prints each setting's mean over
them, with the min and max of its per-order ratio to the first setting: a setting loses only
when its mean is below the first's by more than the first setting's own spread.

``full-length`` and ``shift`` replay early-eos's recorded prompts with every (or the second
half's) output at max_new_tokens, as the real model does with EOS ignored; each ends by EOS on
its 400th token, so the scheduler cannot foresee it (a natural long answer).
``--known-lengths`` sends them with EOS ignored instead, as SGLang's bench_serving does: auto
then plans them at their exact length (``peak_plan.runs_to_max``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import tempfile
import time

import torch
from adaptive_conservativeness import workload

from engine import Engine
from engine.models.checkpoint import open_checkpoint
from engine.models.default import default_model_path
from engine_testing.checkpoints import make_tiny_model

RECORD = os.path.join(tempfile.gettempdir(), "engine-conservativeness-lengths.json")
MAX_NEW = 400
# ms per step, per decoded row, per prompt token: SmolLM2's Q4_1 default on a 2-core Zen 5
# EPYC (2026-11-28, timed as calibrate() does: 1 row 4.4 ms, 16 rows 30.9 ms, 512 prompt
# tokens 577 ms; a --calibrate run later the same hour gave 3.12, 1.82, 1.412)
STEP_COST = (2.6, 1.77, 1.13)
ORDER_BLOCK = 10  # --orders shuffles requests within blocks of this many arrivals
RECORDED = {"fruits": "fruits", "early-eos": "early-eos", "full-length": "early-eos",
            "shift": "early-eos"}


def record(path: str, n: int, tokenizer) -> dict:
    out = {}
    for kind in ("fruits", "early-eos"):
        reqs = workload(kind, n, 500, 24, MAX_NEW, tokenizer)
        engine = Engine(path, max_total_tokens=n * (MAX_NEW + 64))
        rs = [engine.add_request(p, params)[0] for p, params in reqs]
        while engine.scheduler.has_work:
            engine.step()
        out[kind] = [len(r.output_ids) for r in rs]
        print(f"{kind}: {n} outputs, mean {sum(out[kind]) / n:.1f} tokens", flush=True)
    return out


def order(n: int, seed: int) -> list[int]:
    """Order ``seed`` of n requests: 0 as recorded, else shuffled within blocks of ORDER_BLOCK."""
    idx = list(range(n))
    if seed:
        rng = random.Random(seed)
        for b in range(0, n, ORDER_BLOCK):
            block = idx[b:b + ORDER_BLOCK]
            rng.shuffle(block)
            idx[b:b + ORDER_BLOCK] = block
    return idx


def calibrate(path: str) -> tuple[float, float, float]:
    """The real model's step cost here: median decode steps of 1 and 16 rows (a line through
    them: FIXED + ROW x rows) and one 512-token prompt (PROMPT per token, less FIXED)."""
    engine = Engine(path, max_total_tokens=16 * 200)
    step_ms = {}
    for rows in (1, 16):
        for i in range(rows):
            engine.add_request([10 + (i * 7 + j) % 500 for j in range(40)],
                               {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True})
        engine.step()  # the prompts
        times = []
        while engine.scheduler.has_work:
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        step_ms[rows] = statistics.median(times) * 1e3
    row = (step_ms[16] - step_ms[1]) / 15
    fixed = max(step_ms[1] - row, 0.0)
    engine.add_request([10 + (j * 13) % 900 for j in range(512)],
                       {"temperature": 0, "max_new_tokens": 1})
    t = time.perf_counter()
    engine.step()
    prompt = max((time.perf_counter() - t) * 1e3 - fixed, 0.0) / 512
    while engine.scheduler.has_work:
        engine.step()
    return fixed, row, prompt


def replay(model: str, kind: str, lengths: list[int], real_prompts, conservativeness,
           max_total_tokens: int, seed: int = 0, cost=STEP_COST, known: bool = False) -> dict:
    engine = Engine(model, max_total_tokens=max_total_tokens,
                    schedule_conservativeness=conservativeness)
    s = engine.scheduler
    eos = min(s.eos_ids)
    observe = s.ratio.observe

    def step_ms(st) -> float:  # what the step costs on the priced machine
        return cost[0] + cost[1] * st.generated_tokens + cost[2] * st.new_tokens

    def timed(st):  # each step takes the priced machine's time: what auto learns its cost from
        if st.seconds is not None:
            st.seconds = step_ms(st) / 1e3
        observe(st)

    s.ratio.observe = timed
    n = len(lengths)
    target = {}
    reqs = []
    for i, j in enumerate(order(n, seed)):
        prompt, length = real_prompts[j], lengths[j]
        full = kind == "full-length" or (kind == "shift" and i >= n // 2)
        if full:
            length = MAX_NEW
        # a full-length request ends at its 400th token: by EOS (a natural long answer, its
        # length unknown in advance) or, with ``known``, by length with EOS ignored
        r = engine.add_request([10 + t % 200 for t in prompt],
                               {"temperature": 0, "max_new_tokens": MAX_NEW,
                                "ignore_eos": full and known})[0]
        target[r.rid] = length
        reqs.append(r)
    sample = s.sample

    def forced(logits, rows_to_sample, rows):
        out = sample(logits, rows_to_sample, rows)
        out.next_token_ids = torch.tensor(
            [eos if len(r.output_ids) + 1 >= target[r.rid] else 7 for r in rows],
            dtype=out.next_token_ids.dtype)
        return out

    s.sample = forced
    usage, steps, cpu_ms = [], 0, [0.0]

    def on_step(st):
        if st.num_queue_reqs > 0:
            usage.append(st.token_usage)
        cpu_ms[0] += step_ms(st)

    s.on_step = on_step
    while s.has_work:
        engine.step()
        steps += 1
    assert all(len(r.output_ids) == min(target[r.rid], MAX_NEW) for r in reqs)
    return {"steps": steps, "generated": sum(len(r.output_ids) for r in reqs),
            "usage": sum(usage) / max(len(usage), 1), "retracted": s.counters.retracted_reqs,
            "cpu_s": cpu_ms[0] / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="record the real model's lengths")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure the real model's step cost here (for --step-cost)")
    ap.add_argument("--step-cost", default=",".join(map(str, STEP_COST)),
                    help="FIXED,ROW,PROMPT: ms per step, decoded row and prompt token")
    ap.add_argument("--workload", default="fruits", choices=sorted(RECORDED))
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--max-total-tokens", type=int, default=4000)
    ap.add_argument("--settings", default="1.0,0.3,auto")
    ap.add_argument("--orders", type=int, default=1,
                    help="replay this many orders of the requests (see above)")
    ap.add_argument("--lengths", default=RECORD, help="the recorded lengths (JSON)")
    ap.add_argument("--known-lengths", action="store_true",
                    help="full-length requests ignore EOS (as bench_serving's do): auto knows "
                         "they run to max_new_tokens; by default they end by EOS, unforeseen")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    path = default_model_path()
    tokenizer = open_checkpoint(path).load_tokenizer()
    if args.calibrate:
        fixed, row, prompt = calibrate(path)
        print(f"step cost here: {fixed:.2f} ms + {row:.2f} ms per decoded row + {prompt:.3f} ms "
              f"per prompt token: --step-cost {fixed:.2f},{row:.2f},{prompt:.3f}")
        return
    try:
        cost = tuple(float(v) for v in args.step_cost.split(","))
        assert len(cost) == 3 and min(cost) >= 0
    except (ValueError, AssertionError):
        raise SystemExit(f"--step-cost {args.step_cost!r}: give three non-negative numbers "
                         "FIXED,ROW,PROMPT (ms), e.g. --step-cost 2.6,1.77,1.13") from None
    if args.record:
        with open(args.lengths, "w") as f:
            json.dump(record(path, args.requests, tokenizer), f)
        print(f"recorded in {args.lengths}")
        return
    if not os.path.exists(args.lengths):
        raise SystemExit(f"no recorded lengths in {args.lengths}: run with --record first")
    with open(args.lengths) as f:
        lengths = json.load(f)[RECORDED[args.workload]]
    real = [p for p, _ in workload(RECORDED[args.workload], len(lengths), 500, 24, MAX_NEW,
                                   tokenizer)]
    model = make_tiny_model(tempfile.mkdtemp(), "LlamaForCausalLM", hidden_size=64,
                            intermediate_size=128, num_hidden_layers=1)
    print(f"replay of SmolLM2's {args.workload} lengths: {len(lengths)} requests, max_new_tokens "
          f"{MAX_NEW}, --max-total-tokens {args.max_total_tokens}"
          + (", full-length ones ignore EOS (known lengths)" if args.known_lengths else ""))
    def spread(ratios) -> str:  # each order's ratio, min and max (with --orders)
        if ratios is None:
            return f" {'min x':>6} {'max x':>6}" if args.orders > 1 else ""
        return f" {min(ratios):>6.2f} {max(ratios):>6.2f}" if args.orders > 1 else ""

    print(f"{'setting':>8} {'steps':>7} {'tok/step':>8} {'usage(q>0)':>10} {'retracted':>9} "
          f"{'tok/step x':>10}{spread(None)} {'cpu time':>9} {'cpu x':>6}{spread(None)}")
    base = base_cpu = None
    for c in args.settings.split(","):
        runs = [replay(model, args.workload, lengths, real, c if c == "auto" else float(c),
                       args.max_total_tokens, seed, cost, args.known_lengths)
                for seed in range(args.orders)]
        per_step = [r["generated"] / r["steps"] for r in runs]
        cpu = [r["cpu_s"] for r in runs]
        base, base_cpu = base or per_step, base_cpu or cpu
        ratios = [a / b for a, b in zip(per_step, base)]
        cpu_ratios = [b / a for a, b in zip(cpu, base_cpu)]
        mean = sum(per_step) / len(runs)
        line = (f"{c:>8} {sum(r['steps'] for r in runs) / len(runs):>7.0f} {mean:>8.2f} "
                f"{sum(r['usage'] for r in runs) / len(runs):>10.3f} "
                f"{sum(r['retracted'] for r in runs) / len(runs):>9.1f} "
                f"{mean / (sum(base) / len(base)):>10.2f}{spread(ratios)} "
                f"{sum(cpu) / len(cpu):>8.1f}s {sum(base_cpu) / sum(cpu):>6.2f}")
        print(line + spread(cpu_ratios), flush=True)


if __name__ == "__main__":
    main()
