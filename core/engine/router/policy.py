"""The routing-policy contract: what a policy sees of the replicas, and what it answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class RouterOptions:
    """The router's flags, SGLang router's names: past ``balance_abs_threshold`` requests of
    difference AND ``balance_rel_threshold`` times the least loaded, the load is imbalanced;
    ``cache_threshold``: the share of a prompt a replica's tree must match to win by cache."""

    dp_size: int
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    cache_threshold: float = 0.5

    def validate(self) -> "RouterOptions":
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"--router-balance-abs-threshold must be >= 0, got "
                             f"{self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1:
            raise ValueError(f"--router-balance-rel-threshold must be >= 1 (a ratio of the most "
                             f"to the least loaded replica), got {self.balance_rel_threshold}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"--router-cache-threshold must be in [0, 1], got "
                             f"{self.cache_threshold}")
        return self


@dataclass(frozen=True)
class ReplicaView:
    """One live replica as a policy sees it: ``rank`` (its dp rank, stable for its life) and
    ``load`` (requests the front has in flight on it)."""

    rank: int
    load: int


class RoutingPolicy(Protocol):
    def choose(self, text: str, replicas: Sequence[ReplicaView]) -> int:
        """The rank to send a request whose routing text (prompt, messages) is ``text`` to;
        ``replicas`` are the live ones (never empty)."""

    def remove(self, rank: int) -> None:
        """Replica ``rank`` died: forget what is known about it."""
