"""``--schedule-conservativeness auto``: the new-token ratio from the output lengths observed.

SGLang's fixed schedule (admission.NewTokenRatio) reserves 0.7 x conservativeness of every running
request's remaining max_new_tokens and decays that slowly; when requests stop early (EOS, stop
strings) long before max_new_tokens, it holds back KV slots nobody will use and the guide's advice
is to lower the flag by hand. ``auto`` estimates instead the share of max_new_tokens requests
really generate (the mean over recently finished ones), and scales it by a margin that a feedback
loop steers towards the guide's healthy range: token usage > 0.9 with at most about one
retraction a minute.
"""

from __future__ import annotations

import time
from collections import deque

from engine.scheduler.admission import NewTokenRatio

AUTO = "auto"
PRIOR = 0.7  # before requests finish, reserve what conservativeness 1.0 starts with ...
PRIOR_WEIGHT = 4  # ... counted as this many finished requests
WINDOW = 256  # finished requests the estimate remembers
TARGET_USAGE = 0.9  # the guide's "good utilization"
QUIET_S = 60.0  # after a retraction the margin holds this long: about one retraction a minute
MARGIN_DECAY = 0.02  # per step spent under TARGET_USAGE with requests waiting
RETRACT_BUMP = 1.5  # a retraction raises the margin by this factor
MIN_MARGIN, MAX_MARGIN = 0.25, 8.0
MIN_VALUE = 0.01


def make_ratio(conservativeness, clock=time.monotonic):
    """The ratio object for ``--schedule-conservativeness``: a number keeps SGLang's schedule."""
    if conservativeness == AUTO:
        return AdaptiveRatio(clock)
    return NewTokenRatio(conservativeness)


class AdaptiveRatio:
    """The share of remaining max_new_tokens reserved: observed share generated x a margin.

    The margin falls while requests wait with token usage under 0.9 and the batch not full (the
    reservation is what keeps them out), rises after a retraction, and holds for a minute after
    one. Same interface as NewTokenRatio (``value``, ``step``, ``after_retraction``), plus the
    two observations the scheduler reports (``finished``, ``observe``).
    """

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.shares: deque[float] = deque(maxlen=WINDOW)  # output length / max_new_tokens
        self.margin = 1.0
        self.last_retraction: float | None = None

    @property
    def generated_share(self) -> float:
        """The mean share of max_new_tokens finished requests generated (PRIOR before any)."""
        return (sum(self.shares) + PRIOR * PRIOR_WEIGHT) / (len(self.shares) + PRIOR_WEIGHT)

    @property
    def value(self) -> float:
        return min(max(self.generated_share * self.margin, MIN_VALUE), 1.0)

    def step(self) -> None:
        """A decode step ran; the margin moves in ``observe``, which sees the step's usage."""

    def finished(self, req) -> None:
        if req.finish_reason in ("stop", "length") and req.params.max_new_tokens:
            self.shares.append(min(len(req.output_ids) / req.params.max_new_tokens, 1.0))

    def observe(self, stats) -> None:
        waiting_for_room = (stats.num_queue_reqs > 0 and stats.token_usage < TARGET_USAGE
                            and stats.num_running_reqs < stats.max_running_requests
                            and stats.forward_mode in ("decode", "mixed"))
        if waiting_for_room and not self.holding:
            self.margin = max(self.margin * (1 - MARGIN_DECAY), MIN_MARGIN)

    @property
    def holding(self) -> bool:
        """A retraction happened less than QUIET_S ago."""
        return (self.last_retraction is not None
                and self.clock() - self.last_retraction < QUIET_S)

    def after_retraction(self, running) -> tuple[float, float]:
        old = self.value
        self.margin = min(self.margin * RETRACT_BUMP, MAX_MARGIN)
        self.last_retraction = self.clock()
        return old, self.value

    def describe(self) -> str:
        return (f"auto: ratio {self.value:.4f} = share generated {self.generated_share:.3f} "
                f"({len(self.shares)} finished) x margin {self.margin:.3f}")
