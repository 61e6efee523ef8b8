"""`engine tune`'s search vs the exhaustive grid over the same knobs, on a small model.

The grid measures every configuration of 3 conservativeness x 3 chunked-prefill sizes x 2
policies x 2 batch caps (36, each a short offline run through the same Evaluator, so live
changes help both alike); then the search runs with a budget of a fifth of the grid's time.
Printed: each one's best configuration, the time of each and the ratio (target <= 0.2), and how
the search's winner compares with the grid's (target >= 0.95). That comparison is made by
measuring the two winners again, alternating, from fresh engines, ``--repeats`` times each, and
taking the ratio of the medians: the throughput a winner showed in its own trial is the largest
of 36 (the grid) or of a handful (the search) single noisy runs, which favours the grid by how
noisy the machine is, not by how good its configuration is. That ratio of recorded bests is
printed too.

    python benchmarks/tune_vs_grid.py [--model random] [--num-prompts 48] [--repeats 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile

from bench_models import add_model_option, resolve
from bench_models import name as model_name

from engine.bench import Workload
from engine_testing.checkpoints import make_tiny_model
from engine.tune import Evaluator, Objective, run_grid, search, select
from engine.tune.report import command, table

VALUES = {"schedule_conservativeness": ["0.3", "0.7", "1.0"],
          "chunked_prefill_size": ["64", "256", "default"],
          "schedule_policy": ["fcfs", "lpm"], "max_running_requests": ["8", "default"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_option(ap, "a random-init Llama, 2 layers")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-total-tokens", type=int, default=1200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    logging.getLogger("engine").setLevel(logging.ERROR)  # the advisor's lines, per trial
    path = resolve(args.model, lambda: make_tiny_model(tempfile.mkdtemp(prefix="tune-")))
    workload = Workload(num_prompts=args.num_prompts, random_input_len=48,
                        random_output_len=32, random_range_ratio=0.3)
    fixed = {"model": path, "max_total_tokens": args.max_total_tokens, "device": "cpu"}
    knobs = select(list(VALUES), VALUES, set(fixed))
    print(f"model: {model_name(args.model, path)}; workload: {args.num_prompts} random prompts "
          f"(<= 48 in, <= 32 out); --max-total-tokens {args.max_total_tokens}")
    shown = {k.flag: ", ".join("default" if v is None else str(v) for v in k.values)
             for k in knobs}
    print("knobs: " + "; ".join(f"{flag} {values}" for flag, values in shown.items()))
    ev = Evaluator(fixed, workload)
    try:
        full = run_grid(knobs, ev, Objective())
        tuned = search(knobs, ev, Objective(), budget_s=full.seconds / 5)
        winners = [full.best.config, tuned.best.config]
        again = {0: [], 1: []}
        for _ in range(args.repeats):
            for i, config in enumerate(winners):
                ev.close()  # each remeasure from a fresh engine, as `engine serve` would start
                again[i].append(ev(config).measured.output_throughput)
    finally:
        ev.close()
    args_fixed = ["--model", path, "--max-total-tokens", str(args.max_total_tokens)]
    print("\ngrid:\n" + table(full))
    print("\nsearch:\n" + table(tuned))
    print("\nsearch notes:\n" + "\n".join(f"  {n}" for n in tuned.notes))
    g, s = full.best.score, tuned.best.score
    print(f"\n{'':8}{'configs':>8}{'seconds':>10}{'best tok/s':>12}  best")
    print(f"{'grid':8}{len(full.trials):>8}{full.seconds:>10.1f}{g:>12.1f}  "
          f"{command(full.best.config, knobs, args_fixed)}")
    print(f"{'search':8}{len(tuned.trials):>8}{tuned.seconds:>10.1f}{s:>12.1f}  "
          f"{command(tuned.best.config, knobs, args_fixed)}")
    print(f"best throughput as recorded in the trials, search / grid: {s / g:.3f} (the grid's is "
          f"the largest of {len(full.trials)} single runs, the search's of {len(tuned.trials)})")
    print(f"time, search / grid: {tuned.seconds / full.seconds:.3f} (target <= 0.2)")
    mg, ms = statistics.median(again[0]), statistics.median(again[1])
    same = " (the same configuration)" if winners[0] == winners[1] else ""
    print(f"the two winners measured again ({args.repeats}x each, alternating, fresh engines, "
          f"median): grid's {mg:.1f}, search's {ms:.1f} tok/s{same}")
    print(f"search's winner / grid's winner: {ms / mg:.3f} (target >= 0.95)")
    print(f"search's gain over the defaults: {tuned.gain:.2f}x (as measured in its trials)")


if __name__ == "__main__":
    main()
