"""The dp router's cache hit rate: cache_aware against round_robin on a shared-prefix workload.

For each policy, starts `engine serve --dp-size 2 --router-policy <policy>` on 127.0.0.1 (a tiny
random-weight model unless ``--model`` is given), sends ``--groups`` x ``--per-group`` /generate
requests (each group's prompts share a long prefix, a "system prompt", and differ in a short
question; the groups interleave in a shuffled order, ``--concurrency`` in flight) and prints the
prompt-token cache hit rate the replicas report (the front's /metrics: ``engine:cache_hit_rate``
per ``dp_rank`` and in total = cached prompt tokens / prompt tokens over both replicas).

    python benchmarks/router_cache_hit.py
    python benchmarks/router_cache_hit.py --model /path/to/hf-model -- --max-total-tokens 8192

Round-robin sends each group to both replicas, so both prefill (and cache) every prefix;
cache_aware keeps a group on one replica.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from engine.server.process import ServerProcess

WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have "
         "this from or had by word but what some we can out other were all there when up use "
         "your how said an each she which do their time if will way about many then them write "
         "would like so these her long make thing see him two has look more day could go "
         "come").split()


def workload(groups: int, per_group: int, prefix_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        prefix = f"System {g}: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words))
        for q in range(per_group):
            prompts.append(f"{prefix}\nQuestion {q}: " + " ".join(rng.choice(WORDS)
                                                                  for _ in range(6)))
    rng.shuffle(prompts)
    return prompts


def hit_rates(url: str) -> dict[str, float]:
    """'total' and 'dp<rank>' -> engine:cache_hit_rate, from the front's /metrics."""
    rates = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r'engine:cache_hit_rate\{(?:dp_rank="(\d+)",)?model_name="[^"]*"\} (\S+)',
                     line)
        if m:
            rates[f"dp{m.group(1)}" if m.group(1) else "total"] = float(m.group(2))
    return rates


def run(policy: str, model: str, prompts: list[str], args) -> dict:
    log = tempfile.NamedTemporaryFile(suffix=f"-{policy}.log", delete=False).name
    server = ServerProcess(["--model", model, "--dp-size", "2", "--router-policy", policy,
                            *args.serve_flags], log, env={"OMP_NUM_THREADS": "1"})
    try:
        server.wait_ready(timeout=600)

        def one(prompt):
            r = httpx.post(server.url + "/generate", timeout=600, json={
                "text": prompt, "sampling_params": {"max_new_tokens": args.output_len}})
            r.raise_for_status()

        start = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(one, prompts))
        elapsed = time.monotonic() - start
        return {"rates": hit_rates(server.url), "seconds": elapsed}
    except RuntimeError as e:
        raise SystemExit(f"engine serve: {e}") from None
    finally:
        server.stop()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="engine serve --model [default: a tiny random model]")
    ap.add_argument("--groups", type=int, default=8, help="distinct shared prefixes")
    ap.add_argument("--per-group", type=int, default=8, help="requests per prefix")
    ap.add_argument("--prefix-words", type=int, default=150)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("serve_flags", nargs="*", help="more engine serve flags (after --)")
    args = ap.parse_args(argv)

    model = args.model
    if model is None:
        from engine_testing.checkpoints import make_tiny_model

        model = make_tiny_model(tempfile.mkdtemp(prefix="router-bench-"))
    prompts = workload(args.groups, args.per_group, args.prefix_words, args.seed)
    print(f"engine serve --dp-size 2 {' '.join(args.serve_flags)}: {len(prompts)} requests, "
          f"{args.groups} shared prefixes of {args.prefix_words} words, concurrency "
          f"{args.concurrency}")
    results = {p: run(p, model, prompts, args) for p in ("round_robin", "cache_aware")}
    for policy, r in results.items():
        per = "  ".join(f"{k} {v:.3f}" for k, v in sorted(r["rates"].items()) if k != "total")
        print(f"  {policy:12s} cache hit rate {r['rates']['total']:.3f}  ({per})  "
              f"{r['seconds']:.1f} s")
    gain = results["cache_aware"]["rates"]["total"] - results["round_robin"]["rates"]["total"]
    print(f"  cache_aware - round_robin: {gain:+.3f}")
    return 0 if gain > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
