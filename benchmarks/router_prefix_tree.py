"""The cache_aware router's cost per routed request as requests accumulate (issue 28).

Routes ``--requests`` distinct prompts (a shared system prompt of ``--system-chars`` plus a random
suffix of ``--suffix-chars``) over ``--dp-size`` replicas with the cache_aware policy and prints
the mean milliseconds per routed request (match + insert + eviction) in windows, so that a cost
that grows with the requests routed shows. Each replica's share of the tree is ``--max-chars``.

    python benchmarks/router_prefix_tree.py [--requests 4000] [--dp-size 4] [--max-chars 200000]
                                            [--tree PATH_TO_A_prefix_tree.py]

``--tree``: another prefix_tree.py to measure (e.g. the one before issue 28:
``git show 826bcfb:core/engine/router/prefix_tree.py > /tmp/old_tree.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import string
import time

from engine.builtins.routing_policies import CacheAware
from engine.router.policy import ReplicaView, RouterOptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--dp-size", type=int, default=4)
    ap.add_argument("--max-chars", type=int, default=200_000)
    ap.add_argument("--system-chars", type=int, default=1000)
    ap.add_argument("--suffix-chars", type=int, default=1000)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--tree", help="a prefix_tree.py to use instead of engine's")
    args = ap.parse_args()
    rng = random.Random(0)
    policy = CacheAware(RouterOptions(args.dp_size))
    if args.tree:
        spec = importlib.util.spec_from_file_location("other_tree", args.tree)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        policy.tree = mod.PrefixTree(max_chars=args.max_chars)
        if not hasattr(policy.tree, "max_prefix"):  # the tree before issue 28: no cap
            policy.tree.max_prefix = None
    else:
        policy.tree.max_chars = args.max_chars
    systems = ["".join(rng.choices(string.ascii_letters, k=args.system_chars)) for _ in range(8)]
    views = [ReplicaView(rank, 0) for rank in range(args.dp_size)]
    per = args.requests // args.windows
    print(f"{args.requests} requests, dp {args.dp_size}, share {args.max_chars} chars/replica, "
          f"prompts {args.system_chars}+{args.suffix_chars} chars"
          + (f", tree {args.tree}" if args.tree else ""))
    for w in range(args.windows):
        prompts = [rng.choice(systems) + "".join(rng.choices(string.ascii_letters,
                                                             k=args.suffix_chars))
                   for _ in range(per)]
        visits = getattr(policy.tree, "visits", None)
        t0 = time.perf_counter()
        for p in prompts:
            policy.choose(p, views)
        dt = (time.perf_counter() - t0) / per * 1e3
        extra = ("" if visits is None
                 else f", {(policy.tree.visits - visits) / per:.1f} node visits/request")
        print(f"requests {w * per:6d}-{(w + 1) * per:6d}: {dt:8.3f} ms/request{extra}; "
              f"tree sizes {sorted(policy.tree.size.values())}")


if __name__ == "__main__":
    main()
