"""HiCache's counters (hits and bytes moved per tier) and ``--enable-cache-report``'s lines."""

from __future__ import annotations

from dataclasses import dataclass, field

TIERS = ("device", "host", "storage")
MOVES = ("device->host", "host->device", "host->storage", "storage->device")


@dataclass
class TierStats:
    """Cumulative since start: prompt tokens served from each tier at admission, and bytes
    moved between tiers. Written on the engine thread, except ``host->storage`` (the storage
    writer thread; an int add)."""

    hits: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes: dict = field(default_factory=lambda: dict.fromkeys(MOVES, 0))
    step_hits: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # this step's
    storage_rejected: int = 0  # stored pages refused (truncated, corrupt, foreign)
    storage_dropped: int = 0  # page writes dropped because the writer was behind

    def hit(self, tier: str, tokens: int) -> None:
        self.hits[tier] += tokens
        self.step_hits[tier] += tokens

    def moved(self, what: str, nbytes: int) -> None:
        self.bytes[what] += nbytes

    def new_step(self) -> None:
        for t in TIERS:
            self.step_hits[t] = 0

    def step_line(self) -> str:
        """The prefill line's per-tier part: " (device 64, host 32, storage 0)"."""
        return f" ({tier_breakdown(self.step_hits)})"

    def report_line(self, prompt_tokens: int, cached_tokens: int) -> str:
        return cache_report_line(self, prompt_tokens, cached_tokens)


def tier_breakdown(hits: dict) -> str:
    """ "device 64, host 32, storage 0" """
    return ", ".join(f"{t} {hits.get(t, 0)}" for t in TIERS)


def cache_report_line(stats: TierStats, prompt_tokens: int, cached_tokens: int) -> str:
    """The periodic line: the hit rate of each tier over the prompt tokens since start."""
    rate = (lambda n: n / prompt_tokens if prompt_tokens else 0.0)
    mib = 1 << 20
    return (f"Cache report. hit rate: {rate(cached_tokens):.2f} (" +
            ", ".join(f"{t} {rate(stats.hits[t]):.2f}" for t in TIERS) +
            f"), #cached-token: {cached_tokens} of {prompt_tokens} prompt tokens, moved MiB: " +
            ", ".join(f"{m} {stats.bytes[m] / mib:.1f}" for m in MOVES))
