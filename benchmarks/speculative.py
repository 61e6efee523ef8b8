"""Speculative decoding on this CPU: decode tokens per second with ``--speculative-algorithm
NGRAM`` against the same engine without it, on a copy-heavy workload (repeat or edit a given
passage, code with repeated identifiers) and a non-repeating one (stories, explanations), at
concurrency 1 (a person chatting: one request at a time) and 8 (requests decoding together),
greedy, with the outputs checked identical. Both engines run in this process, one after the
other, and each (workload, concurrency) pair alternates them ``--rounds`` times (A B A B ...)
so that a machine whose speed drifts is compared fairly; the ratio is per pair, the median
quoted.

    python benchmarks/speculative.py [--model PATH] [--max-new-tokens 128] [--rounds 2]
        [-- key=value engine options, for both engines]

Decode tok/s at concurrency 1 is the sum of output tokens after the first over the sum of the
times from each request's first token to its last (the prefill is not speculative); at 8 it is
all output tokens over the wall time of the batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from batch1_step import parse_options  # noqa: E402  (key=value engine options)

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
    "wick, polished the great lens, and wound the clockwork that turned the light. Ships "
    "passing the rocky point would see the beam sweep across the water every ten seconds, "
    "and they knew they were safe.")
CODE = '''def merge_sorted_lists(first_list, second_list):
    merged_list = []
    first_index, second_index = 0, 0
    while first_index < len(first_list) and second_index < len(second_list):
        if first_list[first_index] <= second_list[second_index]:
            merged_list.append(first_list[first_index])
            first_index += 1
        else:
            merged_list.append(second_list[second_index])
            second_index += 1
    merged_list.extend(first_list[first_index:])
    merged_list.extend(second_list[second_index:])
    return merged_list
'''
COPY = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this function with the variable merged_list renamed to result:\n\n{CODE}",
    f"Copy this code and add a docstring:\n\n{CODE}",
    f"Correct the spelling in this text and repeat it:\n\n{PASSAGE.replace('the', 'teh')}",
    f"Repeat this text twice:\n\n{PASSAGE}",
    f"Add type hints to this function:\n\n{CODE}",
    f"Quote the following paragraph:\n\n{PASSAGE}",
    f"Rename first_list to left and second_list to right:\n\n{CODE}",
]
FREE = [
    "Write a short story about a fox who learns to fly.",
    "Explain how rainbows form, for a ten year old.",
    "Give three tips for staying focused while studying.",
    "Describe the taste of a ripe mango to someone who never had one.",
    "Write a poem about the first snow of winter.",
    "What are the main differences between cats and dogs as pets?",
    "Tell me about the history of the bicycle.",
    "Plan a relaxing Sunday for a busy parent.",
]


def measure(engine, prompts, concurrency, params):
    """(decode tok/s, outputs) of ``prompts`` run ``concurrency`` at a time."""
    outs, tokens, seconds = [], 0, 0.0
    for i in range(0, len(prompts), concurrency):
        group = prompts[i: i + concurrency]
        reqs = [r for p in group for r in engine.add_request(p, params)]
        start = time.perf_counter()
        while not all(r.finished for r in reqs):
            engine.step()
        end = time.perf_counter()
        if concurrency == 1:
            r = reqs[0]
            tokens += len(r.output_ids) - 1
            seconds += r.finished_time - r.first_token_time
        else:
            tokens += sum(len(r.output_ids) for r in reqs)
            seconds += end - start
        outs += [list(r.output_ids) for r in reqs]
    return tokens / seconds, outs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="[default: the default model]")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--bfs-breadth", type=int, default=None,
                    help="--speculative-ngram-max-bfs-breadth (trees of drafts) for NGRAM")
    ap.add_argument("options", nargs="*", help="engine options key=value (both engines)")
    args = ap.parse_args(argv)

    from engine import Engine
    from engine.models.default import default_model_path

    model = args.model or default_model_path()
    opts = parse_options(args.options)
    base = Engine(model, **opts)
    tree = {"speculative_ngram_max_bfs_breadth": args.bfs_breadth} if args.bfs_breadth else {}
    spec = Engine(model, **opts, speculative_algorithm="NGRAM", **tree)
    chat = base.tokenizer

    def prompt(text):
        return chat.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=False)

    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    for engine in (base, spec):  # warm both (first forwards, graph buffers)
        measure(engine, [prompt(COPY[0])], 1, {**params, "max_new_tokens": 16})
    print(f"{'workload':<12}{'conc.':>6}{'off tok/s':>11}{'NGRAM tok/s':>13}{'ratio':>8}"
          f"{'accept len':>12}  identical")
    for name, texts in (("copy-heavy", COPY), ("random", FREE)):
        prompts = [prompt(t) for t in texts]
        for conc in args.concurrency:
            ratios, offs, ons, same = [], [], [], True
            st = spec.scheduler.spec.stats
            before = (st.tokens, st.request_steps)
            for _ in range(args.rounds):
                off, ref = measure(base, prompts, conc, params)
                on, got = measure(spec, prompts, conc, params)
                offs.append(off)
                ons.append(on)
                ratios.append(on / off)
                same = same and got == ref
            accept = (st.tokens - before[0]) / max(st.request_steps - before[1], 1)
            print(f"{name:<12}{conc:>6}{statistics.median(offs):>11.1f}"
                  f"{statistics.median(ons):>13.1f}{statistics.median(ratios):>7.2f}x"
                  f"{accept:>12.2f}  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
