"""``--schedule-conservativeness auto``: reservations from the output lengths observed.

SGLang's fixed schedule (admission.NewTokenRatio) reserves 0.7 x conservativeness of every running
request's remaining max_new_tokens and decays that slowly; when requests stop early (EOS, stop
strings) long before max_new_tokens, it holds back KV slots nobody will use and the guide's advice
is to lower the flag by hand. ``auto`` estimates instead how many more tokens each running request
will generate from the lengths of recently finished ones: a request that has generated k tokens
is expected to go on like the finished requests that got past k (short outputs say little about a
request that has outlived them). That estimate is scaled by a margin which a feedback loop steers
towards the guide's healthy range: token usage > 0.9 with at most about one retraction a minute.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from itertools import accumulate

from engine.scheduler.admission import NewTokenRatio, reservable_tokens

AUTO = "auto"
PRIOR = 0.7  # with nothing observed, reserve what conservativeness 1.0 starts with ...
PRIOR_WEIGHT = 4  # ... counted as this many finished requests
WINDOW = 256  # finished requests the estimate remembers
TARGET_USAGE = 0.95  # the loop aims here so that usage stays above the guide's 0.9
QUIET_S = 60.0  # after a retraction the margin holds this long: about one retraction a minute
MARGIN_DECAY = 0.02  # per step spent under TARGET_USAGE with requests waiting, at least ...
GAP_DECAY = 0.5  # ... and this times the relative shortfall (a far emptier pool falls faster)
MAX_DECAY = 0.25
MIN_EVIDENCE = PRIOR_WEIGHT  # the margin falls only once this many requests have finished
RETRACT_BUMP = 1.5  # a retraction raises the margin by this factor
MIN_MARGIN, MAX_MARGIN = 0.02, 8.0


def make_ratio(conservativeness, clock=time.monotonic):
    """The ratio object for ``--schedule-conservativeness``: a number keeps SGLang's schedule."""
    if conservativeness == AUTO:
        return AdaptiveRatio(clock)
    return NewTokenRatio(conservativeness)


class OutputShares:
    """Finished requests' output length / max_new_tokens: the last WINDOW, kept sorted, with
    suffix sums so that "the mean share of those past p" costs a binary search."""

    def __init__(self):
        self.recent: deque[float] = deque()
        self.sorted: list[float] = []
        self._suffix: list[float] | None = None

    def __len__(self) -> int:
        return len(self.recent)

    def add(self, share: float) -> None:
        if len(self.recent) == WINDOW:
            old = self.recent.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
        self.recent.append(share)
        bisect.insort(self.sorted, share)
        self._suffix = None

    def beyond(self, p: float) -> tuple[int, float]:
        """How many shares exceed ``p``, and their sum."""
        if self._suffix is None:  # _suffix[i] = sum(sorted[i:])
            self._suffix = list(accumulate(reversed(self.sorted), initial=0.0))[::-1]
        i = bisect.bisect_right(self.sorted, p)
        return len(self.sorted) - i, self._suffix[i]


class AdaptiveRatio:
    """Each running request's expected remaining tokens x a margin.

    The expectation for a request at share p of its max_new_tokens is the mean over finished
    requests whose share exceeded p of (share - p), blended with PRIOR x (1 - p) as PRIOR_WEIGHT
    pseudo-observations. The margin falls while requests wait with token usage under the target
    and the batch not full (the reservation is what keeps them out), faster the emptier the
    pool, but only once MIN_EVIDENCE requests have finished (before that nothing says they stop
    early); it rises after a retraction and holds for a minute after one. Same interface as
    NewTokenRatio (``reserve``, ``step``, ``after_retraction``, ``value``), plus the two
    observations the scheduler reports (``finished``, ``observe``).
    """

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.shares = OutputShares()
        self.margin = 1.0
        self.last_retraction: float | None = None

    def expected_share(self, p: float = 0.0) -> float:
        """The share of max_new_tokens a request at share ``p`` is expected to add."""
        n, total = self.shares.beyond(p)
        return (total - n * p + PRIOR_WEIGHT * PRIOR * (1 - p)) / (n + PRIOR_WEIGHT)

    @property
    def generated_share(self) -> float:
        """The expected share of max_new_tokens a new request generates (PRIOR before any)."""
        return self.expected_share(0.0)

    @property
    def value(self) -> float:
        """What a new request reserves, as a share of its max_new_tokens (for logs)."""
        return min(self.generated_share * self.margin, 1.0)

    def reserve(self, req) -> float:
        """Slots held back for ``req``'s tokens still to come."""
        remaining = reservable_tokens(req)
        max_new = req.params.max_new_tokens
        if not remaining or not max_new:
            return 0.0
        share = self.expected_share(len(req.output_ids) / max_new)
        return min(share * max_new * self.margin, remaining)

    def step(self) -> None:
        """A decode step ran; the margin moves in ``observe``, which sees the step's usage."""

    def finished(self, req) -> None:
        if req.finish_reason in ("stop", "length") and req.params.max_new_tokens:
            self.shares.add(min(len(req.output_ids) / req.params.max_new_tokens, 1.0))

    def observe(self, stats) -> None:
        waiting_for_room = (stats.num_queue_reqs > 0 and stats.token_usage < TARGET_USAGE
                            and stats.num_running_reqs < stats.max_running_requests
                            and stats.forward_mode in ("decode", "mixed")
                            and len(self.shares) >= MIN_EVIDENCE)
        if waiting_for_room and not self.holding:
            shortfall = (TARGET_USAGE - stats.token_usage) / TARGET_USAGE
            decay = min(max(MARGIN_DECAY, GAP_DECAY * shortfall), MAX_DECAY)
            self.margin = max(self.margin * (1 - decay), MIN_MARGIN)

    @property
    def holding(self) -> bool:
        """A retraction happened less than QUIET_S ago."""
        return (self.last_retraction is not None
                and self.clock() - self.last_retraction < QUIET_S)

    def after_retraction(self, running) -> tuple[float, float]:
        old = self.value
        # up to where a new request reserves its whole max_new_tokens, no higher
        cap = min(MAX_MARGIN, max(1 / self.generated_share, 1.0))
        self.margin = max(self.margin, min(self.margin * RETRACT_BUMP, cap))
        self.last_retraction = self.clock()
        return old, self.value

    def describe(self) -> str:
        return (f"auto: new requests reserve {self.value:.4f} of max_new_tokens = expected share "
                f"{self.generated_share:.3f} ({len(self.shares)} finished) x margin "
                f"{self.margin:.3f}")
