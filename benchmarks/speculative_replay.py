"""The NGRAM drafter and the draft policy replayed offline, priced by a step-cost model: how
fast speculation could be on ``benchmarks/speculative.py``'s workloads at concurrency 1 if a
verify step cost what the model says, and what the policy takes from the drafts it gets.

The greedy outputs of the benchmark's prompts are recorded once (the default model, the engine
options given; cached under ``--cache``); then, per workload, each output is decoded again on
paper: at each step the drafter (``engine_spec_ngram``) proposes from the prompt and the tokens
so far, the policy (``engine.speculative.policy.DraftPolicy``, or a fixed length) picks how
many drafts to verify, the step accepts those that equal the recorded tokens and costs
``--step-ms`` + ``--row-ms`` per verified draft (or ``--step-table``: one time per number of
drafts, measured), and the policy learns from it as it does in the engine. Printed: the ratio
of tokens per second against plain steps, and the accepted length.

    python benchmarks/speculative_replay.py [--row-ms 0.3] [--step-ms 3.15]
        [--step-table 3.15,3.50,3.69,3.90,4.26,4.61,5.0,5.40] [--fixed K ...]
        [--max-drafts 7] [-- key=value engine options for the recording]
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from batch1_step import parse_options  # noqa: E402  (key=value engine options)
from speculative import COPY, FREE  # noqa: E402  (the benchmark's prompts)


def record(options: dict, max_new_tokens: int) -> list[tuple[str, list[int], list[int]]]:
    """(workload, prompt ids, greedy output ids) of every benchmark prompt."""
    from engine import Engine
    from engine.models.default import default_model_path

    engine = Engine(default_model_path(), **options)
    chat = engine.tokenizer
    out = []
    for name, texts in (("copy-heavy", COPY), ("random", FREE)):
        for text in texts:
            prompt = chat.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, tokenize=False)
            req = engine.add_request(prompt, {"temperature": 0,
                                              "max_new_tokens": max_new_tokens})[0]
            while not req.finished:
                engine.step()
            out.append((name, list(req.prompt_ids), list(req.output_ids)))
    return out


class _Req:
    """What the drafter and the policy read of a request."""

    def __init__(self, rid: str, prompt_ids: list[int], output_ids: list[int]):
        self.rid, self.prompt_ids, self.output_ids = rid, prompt_ids, output_ids


def replay(runs, workload: str, cost, max_drafts: int, fixed: int | None):
    """(tokens per second against plain steps, tokens per step) of ``workload``'s outputs."""
    from engine.speculative.policy import DraftPolicy
    from engine_spec_ngram.drafter import NgramDrafter

    policy = DraftPolicy(max_drafts)
    seconds = tokens = steps = 0
    for i, (name, prompt, output) in enumerate(runs):
        if name != workload:
            continue
        drafter, t = NgramDrafter(1, 12), 0
        while t < len(output) - 1:  # output[: t + 1] decoded; the next token is output[t + 1]
            req = _Req(str(i), prompt, output[: t + 1])
            limit = min(max_drafts, len(output) - 2 - t)
            draft = drafter.propose([req], [limit])[0] if limit > 0 else None
            k = 0
            if draft is not None and draft.tokens:
                k = (min(fixed, len(draft.tokens)) if fixed is not None
                     else policy.lengths([req], [draft])[0])
            accepted = 0
            for drafted, actual in zip(draft.tokens[:k] if k else [], output[t + 1:]):
                if drafted != actual:
                    break
                accepted += 1
            step = cost(k) / 1000
            if k:
                policy.observe([req], [draft], [k], [accepted], 1 + k, step)
            else:
                policy.observe_plain(1, step)
            seconds += step
            t += accepted + 1
            steps += 1
        tokens += len(output) - 1
        policy.forget(str(i))
    return tokens / seconds * cost(0) / 1000, tokens / max(steps, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=3.15, help="a plain step [3.15]")
    ap.add_argument("--row-ms", type=float, nargs="+", default=[0.3],
                    help="what each verified draft adds to a step; several: one line each")
    ap.add_argument("--step-table", help="comma-separated step ms for 0, 1, 2, ... drafts "
                    "(measured; replaces --step-ms/--row-ms, extended by its last difference)")
    ap.add_argument("--fixed", type=int, nargs="*", default=[],
                    help="also replay verifying up to K drafts whenever there are drafts")
    ap.add_argument("--max-drafts", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~/.cache/engine"),
                                                    "speculative_replay.pkl"))
    ap.add_argument("options", nargs="*", help="engine options key=value (the recording)")
    args = ap.parse_args(argv)
    options = parse_options(args.options)

    key = (sorted(options.items()), args.max_new_tokens)
    runs = None
    if os.path.exists(args.cache):
        with open(args.cache, "rb") as f:
            saved = pickle.load(f)
        runs = saved["runs"] if saved.get("key") == key else None
    if runs is None:
        runs = record(options, args.max_new_tokens)
        os.makedirs(os.path.dirname(args.cache), exist_ok=True)
        with open(args.cache, "wb") as f:
            pickle.dump({"key": key, "runs": runs}, f)

    costs = []
    if args.step_table:
        table = [float(x) for x in args.step_table.split(",")]
        if len(table) < 2:
            ap.error("--step-table needs the times of at least 0 and 1 drafts")
        slope = table[-1] - table[-2]
        print(f"step table (ms for 0, 1, ... drafts): {args.step_table}")
        costs.append(("the table", lambda k: table[k] if k < len(table)
                      else table[-1] + slope * (k - len(table) + 1)))
    else:
        for row in args.row_ms:
            costs.append((f"{args.step_ms} + {row} ms a draft",
                          lambda k, row=row: args.step_ms + row * k))
    print(f"{'step cost':<28}{'drafts':<12}{'workload':<12}{'ratio':>7}{'accept len':>12}")
    for label, cost in costs:
        for fixed in [None, *args.fixed]:
            for workload in ("copy-heavy", "random"):
                ratio, accept = replay(runs, workload, cost, args.max_drafts, fixed)
                how = "policy" if fixed is None else f"fixed {fixed}"
                print(f"{label:<28}{how:<12}{workload:<12}{ratio:>6.2f}x{accept:>12.2f}")


if __name__ == "__main__":
    main()
