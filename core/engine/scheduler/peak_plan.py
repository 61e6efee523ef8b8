"""One step's admission against the predicted peak of the pool's usage, and its pacing
(``--schedule-conservativeness auto``; the reasoning is in adaptive.py's docstring)."""

from __future__ import annotations

import numpy as np

from engine.sampling.params import CONSTRAINT_FIELDS
from engine.scheduler.admission import CLIP_MAX_NEW_TOKENS
from engine.scheduler.survival import SurvivalCurve

GRID = 32  # horizons at which the usage is predicted (0 .. the longest remaining output)
PACE_SLACK = 1.5  # a finish-time bin may hold this x its steady-state share of finishes


def runs_to_max(req) -> bool:
    """Whether ``req`` is certain to generate exactly max_new_tokens: EOS ignored and nothing
    else that can end it (no stop token ids, stop strings or grammar). Benchmark traffic is
    mostly such (SGLang's bench_serving and ``engine bench`` send ``ignore_eos``): ``auto``
    plans such a request at its length, not on the curve, and leaves it out of the curve."""
    p = req.params
    return bool(p.ignore_eos and not p.stop_token_ids and not p.stop and req.grammar is None
                and not any(getattr(p, f, None) for f in CONSTRAINT_FIELDS))


class PeakPlan:
    """One step's admission against the predicted peak of the pool's usage.

    ``held``: what the running requests are counted for (the peak over the horizons of E + z·σ
    + risk x the gap to running to max_new_tokens, plus the prompt tokens that have no slot
    yet); ``reservation(req, extend)``: how much a candidate would raise that peak beyond its
    ``extend`` prompt tokens (the scheduler admits it when ``extend + reservation`` fits the
    room left, i.e. when the new peak fits the pool); ``admitted``: it was.
    """

    def __init__(self, curve: SurvivalCurve, rows: Rows, pending: float, z: float, risk: float,
                 capacity: float | None = None, now: int = 0, curve_paces: bool = True):
        self.curve, self.z, self.risk = curve, z, risk
        self.capacity = capacity  # the pool's tokens: pacing (None: no pacing)
        # pacing a candidate of unknown length needs a curve learnt from finishes (before it
        # is only its prior); one certain to run to max_new_tokens is paced from the start
        self.curve_paces = curve_paces
        self.now = now  # decode steps so far: pacing's bins are fixed in time, not to now
        self.rows = rows
        self.horizon = max(float(rows.rem.max()) if len(rows.p) else 0.0, 1.0)
        self._build()
        self.committed = self.peak  # the peak the scheduler's reserve stands for
        self.peak_admissions = 0  # requests admitted on this plan
        # steps until the finish of a certain candidate pacing refused moves into the next bin
        # (the bins stay in time), after which AdaptiveRatio.plan plans again; 0: none refused
        # (a natural candidate's finish is spread over many bins: its refusal stands longer)
        self.paced = 0.0
        self.held = self.peak + pending

    def _build(self) -> None:
        self.t = np.linspace(0.0, self.horizon, GRID)
        self.t_next = np.append(self.t[1:], self.horizon)
        self.mean, self.var, self.finishes, self.worst = self.moments(self.rows)
        self.peak = self._peak(self.mean, self.var, self.worst)

    def moments(self, rows: Rows):
        """E and Var of the usage change at each horizon, summed over ``rows``, and the
        expected finishes per bin [t_j, t_j+1) (the last bin: from t_last on). Alive at t
        (probability q) a request holds ``start`` + t more slots than now; finished, it gave
        back ``own`` (a running request: start 0; a candidate: start = its prompt, own 0).
        The mean includes the model risk: ``risk`` x (1 - q) x the slots it would hold if it
        ran on, summed over requests (the curve misleads about all of them at once)."""
        if len(rows.p) == 0:
            return np.zeros(GRID), np.zeros(GRID), np.zeros(GRID), np.zeros(GRID)
        q = self.alive(rows, self.t)
        live = self.t[None, :] < rows.rem[:, None]
        # an upper bound over [t_j, t_j+1]: alive as at t_j, grown as at t_j+1 (or its end),
        # so that a peak between two grid points is not missed
        grown = np.minimum(self.t_next[None, :], rows.rem[:, None])
        spread = rows.start[:, None] + grown + rows.own[:, None]  # alive minus finished
        mean = q * spread - rows.own[:, None]
        var = q * (1 - q) * spread ** 2
        gap = np.where(live, (1 - q) * spread, 0.0)
        # the most it can be: every request alive until max_new_tokens ends it
        worst = np.where(live, spread, 0.0) - rows.own[:, None]
        return (mean.sum(0) + self.risk * gap.sum(0), var.sum(0), self.per_bin(q),
                worst.sum(0))

    def alive(self, rows: Rows, t: np.ndarray) -> np.ndarray:
        """[rows, len(t)]: the probability that each request is still running t steps from
        now (max_new_tokens ends it at its ``rem``)."""
        s_now = self.curve(rows.p)
        s_now = np.where(s_now > 0, s_now, 1.0)[:, None]  # past every observation: flat
        q = np.minimum(self.curve(rows.p[:, None] + t[None, :] / rows.m[:, None]) / s_now, 1.0)
        q = np.where(rows.certain[:, None], 1.0, q)  # runs_to_max: alive until its rem
        return np.where(t[None, :] < rows.rem[:, None], q, 0.0)

    @staticmethod
    def per_bin(q: np.ndarray) -> np.ndarray:
        """Expected finishes per bin [t_k, t_k+1) of ``q``'s horizons (the last: from t_last
        on), summed over the requests."""
        qs = q.sum(0)
        return np.append(qs[:-1] - qs[1:], qs[-1])

    def _peak(self, mean, var, worst) -> float:
        """The peak over the horizons of E + z·σ, never above the worst case (every request
        running to its max_new_tokens): the safety terms bound an uncertainty that ends there."""
        return float(max(np.minimum(mean + self.z * np.sqrt(var), worst).max(), 0.0))

    def reservation(self, req, extend: int) -> float:
        if not req.params.max_new_tokens:
            return 0.0
        cand = Rows.of([req], candidate_extend=extend)
        if cand.rem[0] > self.horizon:  # it may run longer than any running request: widen
            self.horizon = float(cand.rem[0])
            self._build()
        mean, var, finishes, worst = self.moments(cand)
        self._last = (req, extend, cand, mean, var, finishes, worst)  # ``admitted`` adds these
        if self.crowded(cand, finishes):
            return float("inf")  # not this step: it would finish in a crowd
        # against the peak already promised (a wider grid may have moved self.peak)
        return (self._peak(self.mean + mean, self.var + var, self.worst + worst)
                - self.committed - extend)

    def spacing(self, cand: Rows) -> float:
        """Steps between two finishes when the pool is kept full of requests like ``cand``
        (steady state): a request's expected token-steps (prompt x E[L] + E[L^2] / 2) over
        the pool's tokens."""
        if cand.certain[0]:  # its length is known (runs_to_max)
            length = float(cand.rem[0])
            square = length * length
            # known lengths stream at this spacing from the first step; the pool peaks just
            # before each finish, L / 2 above its mean use, and two admissions in adjacent bins
            # can be up to a bin closer than the spacing: spaced over the pool less one
            # request's length (SmolLM2's full-length replay at 4000 tokens: 0.99x 1.0's
            # tokens per step over the whole pool, 1.07x over it less L, 1.05x less L / 2)
            pool = max(self.capacity - length, self.capacity / 2)
        else:
            grid = np.linspace(0.0, 1.0, 257)
            s = self.curve(grid)
            dx = np.diff(grid)
            m = float(cand.m[0])
            length = m * float(((s[1:] + s[:-1]) / 2 * dx).sum())  # E[L]
            square = m * m * float((grid[1:] * (s[1:] + s[:-1]) * dx).sum())  # E[L^2]
            pool = self.capacity
        area = float(cand.start[0]) * length + square / 2
        return max(area, 1.0) / pool

    def crowded(self, cand: Rows, finishes: np.ndarray) -> bool:
        """Whether the requests expected to finish in ``cand``'s bins (weighted by its own
        finish probability there, itself included) exceed PACE_SLACK x the steady-state rate.
        Bins are at least one steady-state spacing wide and fixed in time (a request that
        finishes a step after another, admitted a step later, falls in its bin)."""
        if self.capacity is None or not (self.curve_paces or cand.certain[0]):
            return False
        spacing = self.spacing(cand)
        width = self.horizon / (GRID - 1)
        rem = float(cand.rem[0])
        if spacing <= width:  # the plan's own grid is fine enough
            crowd = float((finishes * (self.finishes + finishes)).sum())
            limit = max(PACE_SLACK * width / spacing, 1.0)
            wait = 1.0  # this grid moves with now
        else:
            # bins of one spacing, their edges at multiples of it counted from the first step
            first = spacing - self.now % spacing
            edges = np.concatenate([[0.0], np.arange(first, self.horizon + spacing, spacing)])
            own = self.per_bin(self.alive(cand, edges))
            others = self.per_bin(self.alive(self.rows, edges)) if len(self.rows.p) else 0.0
            crowd = float((own * (others + own)).sum())
            limit = max(PACE_SLACK, 1.0)
            ahead = edges[edges > rem]  # a finish rem steps on reaches the next edge after it
            wait = float(ahead[0] - rem) if len(ahead) else 1.0
        if crowd <= limit:
            return False
        if cand.certain[0]:
            self.paced = wait
        return True

    def admitted(self, req, extend: int) -> None:
        self.peak_admissions += 1
        if not req.params.max_new_tokens:
            return
        last = getattr(self, "_last", None)
        if last is None or last[0] is not req or last[1] != extend:
            self.reservation(req, extend)
        _, _, cand, mean, var, finishes, worst = self._last
        self.rows = self.rows.plus(cand)
        self.mean, self.var, self.worst = self.mean + mean, self.var + var, self.worst + worst
        self.finishes = self.finishes + finishes
        self.peak = self._peak(self.mean, self.var, self.worst)
        self.committed = self.peak


class Rows:
    """Requests as arrays: share p, max_new m, remaining tokens, slots given back when they
    finish (own), slots taken when admitted (start), arrival."""

    __slots__ = ("p", "m", "rem", "own", "start", "arrival", "certain")

    def __init__(self, p, m, rem, own, start, arrival, certain):
        self.p, self.m, self.rem = p, m, rem
        self.own, self.start, self.arrival = own, start, arrival
        self.certain = certain  # runs_to_max: generates exactly max_new_tokens

    @classmethod
    def of(cls, reqs, candidate_extend: int | None = None) -> Rows:
        # one pass over the requests (a step with hundreds running must stay cheap)
        a = np.array([(r.params.max_new_tokens, len(r.output_ids), len(r.prompt_ids),
                       r.cached_tokens, r.arrival, r.params.ignore_eos and runs_to_max(r))
                      for r in reqs if r.params.max_new_tokens],
                     dtype=np.float64).reshape(-1, 6)
        m, out, prompt, cached, arrival, certain = a.T
        rem = np.clip(m - out, 0, CLIP_MAX_NEW_TOKENS)  # admission.reservable_tokens
        if candidate_extend is None:  # running: finishing gives back all but the prefix it
            own = np.maximum(prompt + out - cached, 0)  # found cached (others hold that)
            start = np.zeros(len(m))
        else:
            own, start = np.zeros(len(m)), np.full(len(m), float(candidate_extend))
        return cls(np.minimum(out / m, 1.0), m, rem, own, start, arrival, certain > 0)

    @property
    def victim_len(self) -> float:
        """Prompt + generated tokens of the request retraction would pick first (the fewest
        generated; retract.pick_victims), less what it found cached."""
        out = self.p * self.m
        return float((self.own)[np.argmin(out)]) if len(out) else 0.0

    def plus(self, other: Rows) -> Rows:
        return Rows(*(np.concatenate([getattr(self, k), getattr(other, k)])
                      for k in self.__slots__))
