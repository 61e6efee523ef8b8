"""What a step costs on this machine, learnt from the steps the engine runs: seconds = FIXED +
ROW x decoded rows + PROMPT x prompt tokens, a least-squares fit to recent steps (``auto``
prices a retraction with it: adaptive.py's ``recompute_price``).

A CPU pays for every row (a 2-core Zen 5 ran SmolLM2 at 2.6 ms + 1.2-1.8 ms a row + 0.6-1.1 ms
a prompt token); a GPU's small batches cost about the same whatever they hold and its prompt
tokens little. Until the steps seen pin the three down, pseudo-steps hold the fit at a prior
where half of the mean step is fixed and a prompt token costs what a row does (the price
``auto`` assumed before it measured anything). Per step this is a few float additions: the
fit is solved again only every REFIT steps."""

from __future__ import annotations

import numpy as np

# weight of the past per step observed (a half-life of ~700 steps): a machine's costs do not
# drift, and a long memory keeps the steps of other shapes (a batch filling up, prompts) that
# tell FIXED from ROW while the batch holds the same number of rows for hundreds of steps
DECAY = 0.999
PRIOR_STEPS = 0.05  # each of the three pseudo-steps of the prior weighs this many steps:
# enough to settle what the steps seen leave open (one shape of step only), too little to bend
# what they pin down
OUTLIER = 3.0  # a step slower than this x the fit (another process, a first-time allocation)
MIN_STEPS = 8  # ... once this many steps were seen
REFIT = 16  # steps between two solves of the fit


class StepCostFit:
    def __init__(self):
        # decayed sums over the steps of x x^T's six entries (x = 1, rows, prompt tokens) and
        # of x * seconds, and the decayed count of steps
        self.w = self.r = self.p = self.rr = self.rp = self.pp = 0.0
        self.t = self.rt = self.pt = 0.0
        self.steps = 0
        self.dw = self.dr = self.drr = 0.0  # the same over the steps that decoded rows
        self.decode_steps = 0  # how many steps decoded rows
        self._cost = np.zeros(3)
        self._fitted_at = 0

    def observe(self, rows: int, prompt_tokens: int, seconds: float) -> None:
        if seconds <= 0 or rows + prompt_tokens <= 0:
            return
        if self.steps >= MIN_STEPS:
            f, r, p = self.cost()
            seconds = min(seconds, OUTLIER * (f + r * rows + p * prompt_tokens))
        d = DECAY
        self.w = self.w * d + 1.0
        self.r = self.r * d + rows
        self.p = self.p * d + prompt_tokens
        self.rr = self.rr * d + rows * rows
        self.rp = self.rp * d + rows * prompt_tokens
        self.pp = self.pp * d + prompt_tokens * prompt_tokens
        self.t = self.t * d + seconds
        self.rt = self.rt * d + rows * seconds
        self.pt = self.pt * d + prompt_tokens * seconds
        if rows:
            self.dw, self.dr, self.drr = self.dw * d + 1.0, self.dr * d + rows, \
                self.drr * d + rows * rows
            self.decode_steps += 1
        self.steps += 1

    def cost(self) -> np.ndarray:
        """(FIXED, ROW, PROMPT) in seconds; all zero before any step."""
        if self.steps == 0:
            return np.zeros(3)
        if self._fitted_at == 0 or self.steps - self._fitted_at >= REFIT or \
                self.steps < MIN_STEPS:
            self._cost, self._fitted_at = self._solve(), self.steps
        return self._cost

    def _solve(self) -> np.ndarray:
        mean_rows = max(self.r / self.w, 1.0)
        mean_t = self.t / self.w
        # the prior: FIXED = half the mean step, ROW = PROMPT = the other half per mean row
        prior = np.array([mean_t / 2, mean_t / (2 * mean_rows), mean_t / (2 * mean_rows)])
        pseudo = np.array([[1.0, 1.0, 0.0], [1.0, 2 * mean_rows, 0.0],
                           [1.0, mean_rows, mean_rows]])
        s = np.array([[self.w, self.r, self.p], [self.r, self.rr, self.rp],
                      [self.p, self.rp, self.pp]])
        a = s + PRIOR_STEPS * pseudo.T @ pseudo
        c = np.array([self.t, self.rt, self.pt]) + PRIOR_STEPS * pseudo.T @ (pseudo @ prior)
        try:
            beta = np.linalg.solve(a, c)
        except np.linalg.LinAlgError:
            return prior
        # a step costs something even when empty; rows and prompt tokens never save time
        return np.array([max(beta[0], 0.02 * mean_t), max(beta[1], 0.0), max(beta[2], 0.0)])

    @property
    def mean_rows(self) -> float:
        """The decayed mean of the decoded rows per step seen (0 before any)."""
        return self.r / self.w if self.w else 0.0

    @property
    def row_spread(self) -> float:
        """The decayed standard deviation of the rows of the steps that decoded any: below a
        row or two they cannot tell FIXED from ROW (their split is then the prior's; a step of
        prompt tokens alone tells FIXED from PROMPT, not from ROW)."""
        if not self.dw:
            return 0.0
        mean = self.dr / self.dw
        return float(max(self.drr / self.dw - mean * mean, 0.0) ** 0.5)

    def describe(self) -> str:
        fixed, row, prompt = self.cost() * 1e3
        return f"step {fixed:.2f} ms + {row:.2f} ms/row + {prompt:.3f} ms/prompt token"
