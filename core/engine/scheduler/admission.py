"""Admission: how many waiting requests fit this step (SGLang's budget and its numbers)."""

from __future__ import annotations

from dataclasses import dataclass

# a running request is assumed to need at most this many more tokens when reserving room
CLIP_MAX_NEW_TOKENS = 4096
RETRACT_DECODE_STEPS = 20  # after a retraction, assume every request decodes this much more
MIN_RATIO_FACTOR = 0.14  # the ratio decays to this share of its initial value ...
DECAY_STEPS = 600  # ... over this many decode steps


class NewTokenRatio:
    """The share of each request's remaining max_new_tokens reserved when admitting.

    Starts at min(0.7 x conservativeness, 1), decays linearly each decode step down to 0.14 x
    that, and is raised again after a retraction.
    """

    def __init__(self, conservativeness: float):
        self.init = min(0.7 * conservativeness, 1.0)
        self.min = MIN_RATIO_FACTOR * self.init
        self.decay = (self.init - self.min) / DECAY_STEPS
        self.value = self.init

    def step(self) -> None:
        self.value = max(self.value - self.decay, self.min)

    def after_retraction(self, running) -> tuple[float, float]:
        old = self.value
        total_max_new = sum(r.params.max_new_tokens for r in running)
        decoded = sum(len(r.output_ids) for r in running)
        if total_max_new:
            self.value = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / total_max_new)
        else:
            self.value = 1.0
        return old, self.value


def reserved_tokens(req, ratio: float) -> float:
    return min(max(req.remaining_new_tokens, 0), CLIP_MAX_NEW_TOKENS) * ratio


@dataclass
class PrefillBudget:
    """Token budgets of one step's prefill part."""

    chunk: float  # prompt tokens left under --chunked-prefill-size (inf when disabled)
    prefill: int  # prompt tokens left under --max-prefill-tokens
    page_size: int

    def take(self, extend: int) -> int:
        """How many of ``extend`` prompt tokens fit; a partial take is page-aligned."""
        n = int(min(extend, self.chunk, self.prefill))
        if n < extend:
            n -= n % self.page_size
        return max(n, 0)

    def spend(self, n: int) -> None:
        self.chunk -= n
        self.prefill -= n
