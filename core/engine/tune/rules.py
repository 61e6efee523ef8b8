"""The tuning guides' rules as proposals for the next trial, read from a run's numbers.

Each `Hint` says which way to move an ordered knob first, and whether the other way is pruned
(not tried at all). The thresholds are the advisor's (engine.advice): the same guide, the same
numbers."""

from __future__ import annotations

from dataclasses import dataclass

from engine.advice import GOOD_USAGE, MIN_RETRACTIONS, RETRACTIONS_PER_MINUTE
from engine.tune.trial import Measured

# the knobs that only change who is admitted when: nothing to do when nothing ever waits
ADMISSION_KNOBS = ("schedule_conservativeness", "max_running_requests", "schedule_policy")


@dataclass(frozen=True)
class Hint:
    knob: str
    direction: int  # -1: lower first, +1: higher first
    prune_other: bool  # the opposite direction is not tried
    reason: str


def frequent_retractions(m: Measured) -> bool:
    n = m.retractions or 0
    return n >= MIN_RETRACTIONS and n * 60 / max(m.duration_s, 1e-6) > RETRACTIONS_PER_MINUTE


def client_bound(m: Measured) -> bool:
    """#queue-req was 0 throughout: every request was admitted as it came."""
    return m.peak_queue_reqs is not None and m.peak_queue_reqs == 0


def hints(m: Measured) -> list[Hint]:
    """The guide's proposals for the configuration that measured ``m``."""
    out = []
    if m.prefill_oom:
        out.append(Hint("chunked_prefill_size", -1, True,
                        "out of memory in prefill: smaller chunks"))
    if frequent_retractions(m):
        out.append(Hint("schedule_conservativeness", +1, True,
                        f"{m.retractions} retractions in {m.duration_s:.1f} s: raise "
                        f"conservativeness"))
        out.append(Hint("max_running_requests", -1, False,
                        "frequent retractions: a smaller batch first"))
    elif (m.mean_token_usage is not None and m.mean_token_usage < GOOD_USAGE
          and (m.mean_queue_reqs or 0) > 0):
        out.append(Hint("schedule_conservativeness", -1, not (m.retractions or 0),
                        f"token usage {m.mean_token_usage:.2f} < {GOOD_USAGE} with #queue-req "
                        f"{m.mean_queue_reqs:.1f}: lower conservativeness"))
        out.append(Hint("max_running_requests", +1, False,
                        "requests wait while the pool has room: a bigger batch first"))
    if (m.mean_token_usage is not None and m.mean_token_usage >= GOOD_USAGE
            and (m.mean_queue_reqs or 0) > 0):
        out.append(Hint("mem_fraction_static", +1, False,
                        f"token usage {m.mean_token_usage:.2f} with requests waiting: the pool "
                        f"is the limit, a larger one first"))
    return out
