"""What a step costs on this machine, learnt from the steps the engine runs: seconds = FIXED +
ROW x decoded rows + PROMPT x prompt tokens, a least-squares fit to recent steps (``auto``
prices a retraction with it: adaptive.py's ``priced_z``).

A CPU pays for every row (a 2-core Zen 4 ran SmolLM2 at 2.6 ms + 1.8 ms a row + 1.1 ms a prompt
token); a GPU's small batches cost about the same whatever they hold and its prompt tokens
little. Until the steps seen pin the three down, pseudo-steps hold the fit at a prior where
half of the mean step is fixed and a prompt token costs what a row does (the price ``auto``
assumed before it measured anything)."""

from __future__ import annotations

import numpy as np

DECAY = 0.995  # weight of the past per step observed (a half-life of ~140 steps)
PRIOR_STEPS = 0.05  # each of the three pseudo-steps of the prior weighs this many steps:
# enough to settle what the steps seen leave open (one shape of step only), too little to bend
# what they pin down
OUTLIER = 3.0  # a step slower than this x the fit (another process, a first-time allocation)
MIN_STEPS = 8  # ... once this many steps were seen


class StepCostFit:
    def __init__(self):
        self.s = np.zeros((3, 3))  # decayed sum of x x^T, x = (1, rows, prompt tokens)
        self.b = np.zeros(3)  # decayed sum of x * seconds
        self.w = 0.0  # decayed count of steps
        self.steps = 0

    def observe(self, rows: int, prompt_tokens: int, seconds: float) -> None:
        if seconds <= 0 or rows + prompt_tokens <= 0:
            return
        x = np.array([1.0, rows, prompt_tokens])
        if self.steps >= MIN_STEPS:
            seconds = min(seconds, OUTLIER * float(x @ self.cost()))
        self.s = self.s * DECAY + np.outer(x, x)
        self.b = self.b * DECAY + x * seconds
        self.w = self.w * DECAY + 1.0
        self.steps += 1

    def cost(self) -> np.ndarray:
        """(FIXED, ROW, PROMPT) in seconds; all zero before any step."""
        if self.w == 0:
            return np.zeros(3)
        mean_rows = max(self.s[0, 1] / self.w, 1.0)
        mean_t = self.b[0] / self.w
        # the prior: FIXED = half the mean step, ROW = PROMPT = the other half per mean row
        prior = np.array([mean_t / 2, mean_t / (2 * mean_rows), mean_t / (2 * mean_rows)])
        pseudo = np.array([[1.0, 1.0, 0.0], [1.0, 2 * mean_rows, 0.0],
                           [1.0, mean_rows, mean_rows]])
        a = self.s + PRIOR_STEPS * pseudo.T @ pseudo
        c = self.b + PRIOR_STEPS * pseudo.T @ (pseudo @ prior)
        try:
            beta = np.linalg.solve(a, c)
        except np.linalg.LinAlgError:
            return prior
        # a step costs something even when empty; rows and prompt tokens never save time
        return np.array([max(beta[0], 0.02 * mean_t), max(beta[1], 0.0), max(beta[2], 0.0)])

    def describe(self) -> str:
        fixed, row, prompt = self.cost() * 1e3
        return f"step {fixed:.2f} ms + {row:.2f} ms/row + {prompt:.3f} ms/prompt token"
