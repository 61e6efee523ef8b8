"""A weighted Kaplan-Meier survival curve of output shares (``--schedule-conservativeness auto``:
adaptive.py builds it, peak_plan.py reads it)."""

from __future__ import annotations

import numpy as np


class SurvivalCurve:
    """A weighted Kaplan-Meier estimate S(x) = P(share > x) (a step function)."""

    def __init__(self, shares, events, weights, hazard: float = 1.0):
        shares = np.asarray(shares, dtype=np.float64)
        events = np.asarray(events, dtype=bool)
        weights = np.asarray(weights, dtype=np.float64)
        order = np.lexsort((events.astype(np.int8) * -1, shares))  # at ties, events first
        self.x = shares[order]
        w, ev = weights[order], events[order]
        at_risk = np.cumsum(w[::-1])[::-1]  # weight of the observations from here on
        factor = np.where(ev, 1.0 - w / np.maximum(at_risk, 1e-12), 1.0)
        self.hazard = hazard
        self.s = np.cumprod(factor) ** hazard  # S just after each observation

    def __call__(self, x):
        """S at ``x`` (an array): the product over the events at shares <= x."""
        i = np.searchsorted(self.x, x, side="right")
        return np.where(i > 0, self.s[np.maximum(i - 1, 0)], 1.0)

    def expected_share(self, p: float = 0.0) -> float:
        """The share of max_new_tokens a request alive at share ``p`` is expected to add:
        the integral of S(x) / S(p) over [p, 1]."""
        grid = np.linspace(p, 1.0, 257)
        s = self(grid)
        sp = s[0] if s[0] > 0 else 1.0
        area = float(((s[1:] + s[:-1]) / 2 * np.diff(grid)).sum())  # the trapezoid rule
        return area / sp
