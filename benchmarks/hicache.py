"""HiCache on a multi-turn chat workload whose working set is about 4x the device KV pool:
the cache hit rate and the output throughput with --enable-hierarchical-cache (host tier, and
host + file storage) against the radix cache alone, then a restart with the file backend.

N conversations x M turns (engine.bench.workloads' multi-turn, with the model's real answers):
every round each conversation sends its next turn, which is its whole history (earlier
prompts and the model's answers, greedy, fixed length) plus ``--turn-len`` new tokens; all of a
round's turns are queued at once and the round runs to the end before the next. The device
pool (``--max-total-tokens``) holds about a quarter of all histories, so without HiCache a
conversation's prefix is evicted by the others before its next turn. Settings are run in turn,
``--repeats`` times each, alternating (the machine is shared), with the same outputs checked.
Then a new engine on the file backend's directory (a restart) gets every conversation's next
turn: the share of each prefix it serves from storage.

    python benchmarks/hicache.py [--model default|PATH] [--conversations 16] [--turns 4]
        [--turn-len 96] [--output-len 32] [--max-total-tokens 2048] [--hicache-ratio 4]
        [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time

from engine import Engine

SETTINGS = {
    "off": {},
    "host": {"enable_hierarchical_cache": True},
    "host+file": {"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
                  "hicache_storage_prefetch_policy": "wait_complete"},
    # the same with the overlap scheduler (--enable-overlap-schedule)
    "off+overlap": {"enable_overlap_schedule": True},
    "host+overlap": {"enable_hierarchical_cache": True, "enable_overlap_schedule": True},
}


def model_path(name: str) -> str:
    if name == "default":
        from engine.models.default import default_model_path

        return default_model_path()
    return name


def run_rounds(engine, conversations: list[list[int]], turns: int, turn_len: int,
               output_len: int, seed: int):
    """Every conversation's ``turns`` turns, round by round; returns (outputs, prompt tokens,
    cached tokens, output tokens, seconds)."""
    rng = random.Random(seed)
    vocab = engine.runner.model_config.vocab_size
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    outputs, prompt, cached, generated, seconds = [], 0, 0, 0, 0.0
    for _ in range(turns):
        for history in conversations:
            history += [rng.randrange(100, min(vocab, 20000)) for _ in range(turn_len)]
        start = time.perf_counter()
        reqs = [r for h in conversations for r in engine.add_request(list(h), params)]
        while not all(r.finished for r in reqs):
            engine.step()
        seconds += time.perf_counter() - start
        for h, r in zip(conversations, reqs):
            h += r.output_ids
            outputs.append(list(r.output_ids))
            prompt += len(r.prompt_ids)
            cached += r.cached_tokens
            generated += len(r.output_ids)
    return outputs, prompt, cached, generated, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-total-tokens", type=int, default=2048)
    ap.add_argument("--hicache-ratio", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", default="off,host,host+file")
    args = ap.parse_args()
    path = model_path(args.model)
    names = args.settings.split(",")
    final = args.conversations * args.turns * (args.turn_len + args.output_len)
    print(f"{args.conversations} conversations x {args.turns} turns of {args.turn_len} new + "
          f"{args.output_len} output tokens: the histories end at {final} tokens in all, "
          f"{final / args.max_total_tokens:.1f}x the device pool ({args.max_total_tokens}); "
          f"host pool {args.hicache_ratio:g}x the device pool")
    results = {n: [] for n in names}
    reference = None
    storage = None
    for rep in range(args.repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):  # alternate A/B order
            flags = dict(SETTINGS[name])
            if flags.get("enable_hierarchical_cache"):
                flags["hicache_ratio"] = args.hicache_ratio
            if "hicache_storage_backend" in flags:
                if storage is not None:
                    shutil.rmtree(storage)
                storage = tempfile.mkdtemp(prefix="hicache-bench-")
                flags["hicache_storage_dir"] = storage
            engine = Engine(path, max_total_tokens=args.max_total_tokens, **flags)
            convs = [[] for _ in range(args.conversations)]
            outs, prompt, cached, gen, secs = run_rounds(engine, convs, args.turns,
                                                         args.turn_len, args.output_len, seed=1)
            engine.close()
            if reference is None:
                reference = outs
            same = outs == reference
            results[name].append((cached / prompt, gen / secs, secs, same))
            print(f"  run {rep + 1} {name:>9}: hit rate {cached / prompt:.3f} ({cached}/{prompt} "
                  f"prompt tokens), {gen / secs:.1f} output tok/s, {secs:.1f} s, outputs "
                  f"{'identical' if same else 'DIFFER'}")
    base = results[names[0]]
    b_hit = statistics.median(r[0] for r in base)
    b_tps = statistics.median(r[1] for r in base)
    print("\nsetting    hit rate (x off)    output tok/s (x off)   [medians]")
    for name in names:
        hit = statistics.median(r[0] for r in results[name])
        tps = statistics.median(r[1] for r in results[name])
        print(f"{name:>9}  {hit:.3f} ({hit / b_hit if b_hit else float('inf'):.2f}x)     "
              f"{tps:.1f} ({tps / b_tps:.2f}x)")
    if storage is not None:
        restart(path, args, storage)
        shutil.rmtree(storage)


def restart(path: str, args, storage: str) -> None:
    """A new engine on the last host+file run's directory: each conversation's next turn."""
    engine = Engine(path, max_total_tokens=args.max_total_tokens,
                    **SETTINGS["host+file"], hicache_ratio=args.hicache_ratio,
                    hicache_storage_dir=storage)
    # the same conversations again (same seed, same greedy answers) up to their last turn
    probe = Engine(path, max_total_tokens=args.max_total_tokens)
    convs = [[] for _ in range(args.conversations)]
    run_rounds(probe, convs, args.turns, args.turn_len, args.output_len, seed=1)
    rng = random.Random(2)
    shares = []
    params = {"temperature": 0, "max_new_tokens": 1}
    for h in convs:
        prompt = h + [rng.randrange(100, 20000) for _ in range(args.turn_len)]
        [r] = engine.add_request(prompt, params)
        while not r.finished:
            engine.step()
        shares.append(r.cached_tokens / len(h))
    engine.close()
    print(f"\nafter a restart (file backend): the first turn of each known conversation got "
          f"{min(shares):.3f} .. {max(shares):.3f} (mean {statistics.mean(shares):.3f}) of its "
          f"known prefix ({len(convs[0])} tokens) as cached tokens")


if __name__ == "__main__":
    main()
