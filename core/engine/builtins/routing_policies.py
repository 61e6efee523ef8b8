"""The ``--router-policy`` built-ins of the ``--dp-size`` front: round_robin, shortest_queue and
cache_aware (SGLang router's)."""

from __future__ import annotations

import itertools
from typing import Sequence

from engine.hookspecs import hookimpl
from engine.router.policy import ReplicaView, RouterOptions
from engine.router.prefix_tree import PrefixTree


class RoundRobin:
    """Each live replica in turn."""

    def __init__(self, options: RouterOptions):
        self._counter = itertools.count()

    def choose(self, text: str, replicas: Sequence[ReplicaView]) -> int:
        return replicas[next(self._counter) % len(replicas)].rank

    def remove(self, rank: int) -> None:
        pass


class ShortestQueue:
    """The replica with the fewest requests in flight (the lowest rank on a tie)."""

    def __init__(self, options: RouterOptions):
        pass

    def choose(self, text: str, replicas: Sequence[ReplicaView]) -> int:
        return min(replicas, key=lambda r: (r.load, r.rank)).rank

    def remove(self, rank: int) -> None:
        pass


class CacheAware:
    """SGLang router's cache_aware: while the load is balanced, the replica whose prefix tree
    matches the most of the prompt (when it matches more than ``cache_threshold`` of it), else
    the replica with the smallest tree; when the load is imbalanced (the most loaded has more
    than ``balance_abs_threshold`` requests more than the least loaded AND more than
    ``balance_rel_threshold`` times as many), the least loaded. The prompt goes into the chosen
    replica's tree either way. Only the prompt's first ``PrefixTree.max_prefix`` characters
    count (the tree's cap), in the share the threshold asks for too."""

    def __init__(self, options: RouterOptions):
        self.options = options
        self.tree = PrefixTree()

    def imbalanced(self, replicas: Sequence[ReplicaView]) -> bool:
        most = max(r.load for r in replicas)
        least = min(r.load for r in replicas)
        o = self.options
        return most - least > o.balance_abs_threshold and most > least * o.balance_rel_threshold

    def choose(self, text: str, replicas: Sequence[ReplicaView]) -> int:
        text = text[:self.tree.max_prefix]
        live = {r.rank for r in replicas}
        if self.imbalanced(replicas):
            rank = min(replicas, key=lambda r: (r.load, r.rank)).rank
        else:
            matched = {k: v for k, v in self.tree.match(text).items() if k in live}
            best = max(matched, key=lambda k: (matched[k], -k), default=None)
            if best is not None and matched[best] > self.options.cache_threshold * len(text):
                rank = best
            else:
                rank = min(live, key=lambda k: (self.tree.size.get(k, 0), k))
        self.tree.insert(text, rank)
        return rank

    def remove(self, rank: int) -> None:
        self.tree.remove(rank)


@hookimpl
def register_routing_policies(register):
    register("round_robin", RoundRobin, description="each live replica in turn")
    register("shortest_queue", ShortestQueue,
             description="the replica with the fewest requests in flight")
    register("cache_aware", CacheAware,
             description="the longest prompt-prefix match while the load is balanced, "
                         "the least loaded past the balance thresholds (SGLang router's)")
