"""Which drafts a verify step runs: each request's acceptance (how often its drafts have been
right) against the measured cost of a forward's extra tokens, so that speculation runs where
it pays and stays off where it does not (text that does not repeat, a batch already big).

A draft token ``j`` of request ``r`` is worth ``alpha_r ** j`` expected tokens (it counts only
if every draft before it was accepted); the step time of ``M`` tokens is a line ``a + b * M``
fitted to the steps this engine ran (recent ones weigh more). Drafts are taken best first while
they raise the step's expected tokens per second. A request whose drafts stopped paying is
tried again with one draft now and then, so that its acceptance is not frozen at a bad guess:
in a step that verifies drafts anyway (the probe costs one more row), else at most one probe
per PROBE_EVERY steps for the whole batch (a probe turns a plain step into a verify step; with
one per request every PROBE_EVERY steps, eight requests on text that does not repeat probed in
half of the steps and ran at 0.90x of speculation off)."""

from __future__ import annotations

import heapq

PRIOR_ALPHA = 0.5  # a request's acceptance before it has verified anything
ALPHA_DECAY = 0.7  # weight of a request's past against its last verify step
KIND_DECAY = 0.95  # the same for a kind of draft (all requests' drafts of that kind)
COST_DECAY = 0.98  # weight of the cost fit's past against one step
PRIOR_SLOPE = 0.2  # an extra token costs this share of a one-token step until measured
PRIOR_WEIGHT = 4.0  # how many steps' worth of evidence that prior is
OUTLIER = 3.0  # a step slower than this many times the fit counts as this many
PROBE_EVERY = 16  # steps a request goes without drafts before one is tried again (and steps
# between probes that alone turn a plain step into a verify step)


class StepCost:
    """Seconds of a forward over ``M`` tokens, as a line fitted to observed steps."""

    def __init__(self):
        self.w = self.sm = self.st = self.smm = self.smt = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if self.w >= 8:  # a step held up (another process, a first-time allocation): capped
            seconds = min(seconds, OUTLIER * self(tokens))
        d = COST_DECAY
        self.w = self.w * d + 1.0
        self.sm = self.sm * d + tokens
        self.st = self.st * d + seconds
        self.smm = self.smm * d + tokens * tokens
        self.smt = self.smt * d + tokens * seconds

    def line(self) -> tuple[float, float]:
        """(a, b): t(M) = a + b * M; the slope leans on PRIOR_SLOPE until steps of several
        sizes were seen."""
        if self.w == 0:
            return 1.0, PRIOR_SLOPE
        mean_m, mean_t = self.sm / self.w, self.st / self.w
        var = self.smm / self.w - mean_m * mean_m
        cov = self.smt / self.w - mean_m * mean_t
        unit = mean_t / (1 + PRIOR_SLOPE * (mean_m - 1))  # a one-token step, by the prior
        prior_b = PRIOR_SLOPE * unit
        lam = PRIOR_WEIGHT / self.w
        b = max((cov + lam * prior_b) / (var + lam), 0.0)
        return max(mean_t - b * mean_m, 1e-9), b

    def __call__(self, tokens: int, line=None) -> float:
        a, b = line or self.line()
        return a + b * tokens


class DraftPolicy:
    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self.alpha: dict[str, float] = {}  # per request
        self.kind_alpha: dict[int, float] = {}  # per kind of draft (Draft.kind), all requests
        self.idle: dict[str, int] = {}  # steps since the request last verified a draft
        self.since_probe = 0  # steps since a probe alone made a step verify
        self.cost = StepCost()

    def acceptance(self, rid: str, kind: int) -> float:
        """The chance that a draft token of this request and kind is right (given the ones
        before it were): the request's own record and its kind's, averaged."""
        k = self.kind_alpha.get(kind, PRIOR_ALPHA)
        return 0.5 * (self.alpha.get(rid, k) + k)

    def lengths(self, reqs: list, drafts: list) -> list[int]:
        """How many tokens of each request's draft (``Draft``) to verify this step."""
        line = self.cost.line()
        n = len(reqs)
        take = [0] * n
        alphas = [self.acceptance(r.rid, d.kind) for r, d in zip(reqs, drafts)]
        worth = [_worth(d, a) for d, a in zip(drafts, alphas)]
        heap = [(-worth[i][0], i) for i in range(n) if drafts[i].tokens]
        heapq.heapify(heap)
        expected, tokens = float(n), n
        rate = expected / self.cost(tokens, line)
        while heap:  # the best next draft first (a request's values fall as it takes more)
            v, i = heapq.heappop(heap)
            new_rate = (expected - v) / self.cost(tokens + 1, line)
            if new_rate <= rate:
                break
            take[i] += 1
            expected, tokens, rate = expected - v, tokens + 1, new_rate
            if take[i] < len(drafts[i].tokens):
                heapq.heappush(heap, (-worth[i][take[i]], i))
        idle, due = self.idle, []
        for i, r in enumerate(reqs):  # requests left out for a while are due a probe
            if drafts[i].tokens and not take[i]:
                idle[r.rid] = k = idle.get(r.rid, 0) + 1
                if k >= PROBE_EVERY:
                    due.append(i)
        self.since_probe += 1
        if due and not any(take):  # a plain step: one probe, now and then
            if self.since_probe < PROBE_EVERY:
                return take
            due = [max(due, key=lambda i: idle[reqs[i].rid])]
            self.since_probe = 0
        for i in due:  # (in a verify step every due request: a row each)
            take[i], idle[reqs[i].rid] = 1, 0
        return take

    def observe(self, reqs: list, drafts: list, taken: list[int], accepted: list[int],
                tokens: int, seconds: float) -> None:
        """A step verified ``taken[i]`` tokens of request ``i``'s draft and accepted
        ``accepted[i]``; its forward ran ``tokens`` tokens in ``seconds``."""
        self.cost.observe(tokens, seconds)
        kinds = self.kind_alpha
        for r, d, k, a in zip(reqs, drafts, taken, accepted):
            if not k:
                continue
            self.idle[r.rid] = 0
            rate = a / min(a + 1, k)  # each draft tried is a trial; the first miss ends them
            old = kinds.get(d.kind, PRIOR_ALPHA)
            kinds[d.kind] = KIND_DECAY * old + (1 - KIND_DECAY) * rate
            old = self.alpha.get(r.rid, old)
            self.alpha[r.rid] = ALPHA_DECAY * old + (1 - ALPHA_DECAY) * rate

    def observe_plain(self, tokens: int, seconds: float) -> None:
        """A step without drafts: its cost still teaches the fit."""
        self.cost.observe(tokens, seconds)

    def forget(self, rid: str) -> None:
        self.alpha.pop(rid, None)
        self.idle.pop(rid, None)


def _worth(draft, alpha: float) -> list[float]:
    """Each draft token's expected tokens: alpha ** depth along a chain; in a tree a node is
    also worth (1 - alpha) per earlier sibling on its path (an alternative counts only where
    the likelier branch before it was wrong)."""
    if draft.parents is None:
        out, v = [], 1.0
        for _ in draft.tokens:
            v *= alpha
            out.append(v)
        return out
    out, seen = [], {}
    for p in draft.parents:
        rank = seen.get(p, 0)
        seen[p] = rank + 1
        out.append((out[p] if p >= 0 else 1.0) * alpha * (1 - alpha) ** rank)
    return out
