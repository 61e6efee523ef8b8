"""--schedule-conservativeness settings on the real model's output lengths, without its time.

The real model's greedy outputs are fixed, so which requests run when depends only on their
lengths and the admission logic. This script records, once, the default model's (SmolLM2)
output lengths for a workload of ``adaptive_conservativeness.py`` (``--record``: one run with a
pool big enough that nothing waits), then replays them through the real scheduler on a 1-layer
random model whose sampled token is replaced by EOS at each request's recorded length (and by
a plain token before it). Prompts are the real ones (ids folded into the tiny vocabulary, so
shared prefixes stay shared in the radix cache). Steps, tokens per step, token usage with a
queue and retractions come out as on the real model (1.0 on fruits: 2266 steps and 8
retractions both ways); wall time does not, so it is not printed.

    python benchmarks/conservativeness_replay.py --record [--workload fruits] [--requests 120]
    python benchmarks/conservativeness_replay.py [--workload fruits|early-eos|full-length|shift]
        [--max-total-tokens 4000] [--settings 1.0,0.3,auto]

``full-length`` and ``shift`` replay early-eos's recorded prompts with every (or the second
half's) output at max_new_tokens, as the real model does with EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile

import torch
from adaptive_conservativeness import workload

from engine import Engine
from engine.models.checkpoint import open_checkpoint
from engine.models.default import default_model_path
from engine_testing.checkpoints import make_tiny_model

RECORD = os.path.join(tempfile.gettempdir(), "engine-conservativeness-lengths.json")
MAX_NEW = 400
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


def replay(model: str, kind: str, lengths: list[int], real_prompts, conservativeness,
           max_total_tokens: int) -> dict:
    engine = Engine(model, max_total_tokens=max_total_tokens,
                    schedule_conservativeness=conservativeness)
    s = engine.scheduler
    eos = min(s.eos_ids)
    n = len(lengths)
    target = {}
    reqs = []
    for i, (prompt, length) in enumerate(zip(real_prompts, lengths)):
        if kind == "full-length" or (kind == "shift" and i >= n // 2):
            length = MAX_NEW
        r = engine.add_request([10 + t % 200 for t in prompt],
                               {"temperature": 0, "max_new_tokens": MAX_NEW})[0]
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
    usage, steps = [], 0
    s.on_step = lambda st: usage.append(st.token_usage) if st.num_queue_reqs > 0 else None
    while s.has_work:
        engine.step()
        steps += 1
    assert all(len(r.output_ids) == min(target[r.rid], MAX_NEW) for r in reqs)
    return {"steps": steps, "generated": sum(len(r.output_ids) for r in reqs),
            "usage": sum(usage) / max(len(usage), 1), "retracted": s.counters.retracted_reqs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="record the real model's lengths")
    ap.add_argument("--workload", default="fruits", choices=sorted(RECORDED))
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--max-total-tokens", type=int, default=4000)
    ap.add_argument("--settings", default="1.0,0.3,auto")
    ap.add_argument("--lengths", default=RECORD, help="the recorded lengths (JSON)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    path = default_model_path()
    tokenizer = open_checkpoint(path).load_tokenizer()
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
          f"{MAX_NEW}, --max-total-tokens {args.max_total_tokens}")
    print(f"{'setting':>8} {'steps':>6} {'tok/step':>8} {'usage(q>0)':>10} {'retracted':>9} "
          f"{'tok/step x':>10}")
    base = None
    for c in args.settings.split(","):
        r = replay(model, args.workload, lengths, real, c if c == "auto" else float(c),
                   args.max_total_tokens)
        per_step = r["generated"] / r["steps"]
        base = base or per_step
        print(f"{c:>8} {r['steps']:>6} {per_step:>8.2f} {r['usage']:>10.3f} {r['retracted']:>9} "
              f"{per_step / base:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
