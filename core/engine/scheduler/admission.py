"""Admission: how many waiting requests fit this step (SGLang's budget and its numbers)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.scheduler.request import Req, Status

# a running request is assumed to need at most this many more tokens when reserving room
CLIP_MAX_NEW_TOKENS = 4096
RETRACT_DECODE_STEPS = 20  # after a retraction, assume every request decodes this much more
MIN_RATIO_FACTOR = 0.14  # the ratio decays to this share of its initial value ...
DECAY_STEPS = 600  # ... over this many decode steps
# a waiting prompt sharing this many uncached tokens with one being prefilled waits for it
IN_BATCH_PREFIX = 32


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

    def reserve(self, req) -> float:
        """Slots held back for ``req``'s tokens still to come."""
        return reservable_tokens(req) * self.value

    def plan(self, running, capacity: int | None = None) -> SumPlan:
        """This step's admission: every request's reservation, summed (``capacity``, the
        pool's tokens, is for adaptive.py's pacing: the fixed schedule does not pace)."""
        return SumPlan(self, running)

    def step(self) -> None:
        self.value = max(self.value - self.decay, self.min)

    def finished(self, req) -> None:
        """The fixed schedule learns nothing from finished requests (adaptive.py's does)."""

    def observe(self, stats) -> None:
        """Nor from a step's usage."""

    def after_retraction(self, running, victims=()) -> tuple[float, float]:
        old = self.value
        total_max_new = sum(r.params.max_new_tokens for r in running)
        decoded = sum(len(r.output_ids) for r in running)
        if total_max_new:
            self.value = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / total_max_new)
        else:
            self.value = 1.0
        return old, self.value


def reservable_tokens(req) -> int:
    """The new tokens a request may still generate, clipped at CLIP_MAX_NEW_TOKENS (what any
    reservation for it is a share of)."""
    return min(max(req.remaining_new_tokens, 0), CLIP_MAX_NEW_TOKENS)


def still_needed(running, ratio) -> float:
    """What the running requests are still counted for: the slots ``ratio`` reserves for their
    new tokens plus the prompt tokens that have no slot yet (a chunk allocated this step
    already holds its slots: counting it again would hold new requests back)."""
    return sum(ratio.reserve(r) + max(r.seq_len - r.alloc_len, 0) for r in running)


class SumPlan:
    """SGLang's admission arithmetic for one step: ``held`` is what the running requests are
    counted for (``still_needed``), a candidate reserves ``ratio.reserve`` on top (the shares
    add up; adaptive.PeakPlan is the other kind: a candidate adds what it raises a peak by)."""

    def __init__(self, ratio, running):
        self.ratio = ratio
        self.held = still_needed(running, ratio)

    def reservation(self, req, extend: int) -> float:
        """Slots ``req`` holds back beyond its ``extend`` uncached prompt tokens."""
        return self.ratio.reserve(req)

    def admitted(self, req, extend: int) -> None:
        """``req`` was admitted with ``reservation(req, extend)``."""


@dataclass
class PrefillBudget:
    """Token budgets of one step's prefill part."""

    chunk: float  # prompt tokens left under --chunked-prefill-size (inf when disabled)
    prefill: int  # prompt tokens left under --max-prefill-tokens
    page_size: int

    @classmethod
    def for_step(cls, chunked_prefill_size: int, num_decodes: int, max_prefill_tokens: int,
                 page_size: int) -> PrefillBudget:
        """A step's chunk budget is --chunked-prefill-size less its decodes (-1: unlimited)."""
        chunk = (float("inf") if chunked_prefill_size == -1 else
                 max(chunked_prefill_size - num_decodes, 0))
        return cls(chunk, max_prefill_tokens, page_size)

    def take(self, extend: int) -> int:
        """How many of ``extend`` prompt tokens fit; a partial take is page-aligned."""
        n = int(min(extend, self.chunk, self.prefill))
        if n < extend:
            n -= n % self.page_size
        return max(n, 0)

    def spend(self, n: int) -> None:
        self.chunk -= n
        self.prefill -= n


@dataclass
class StepPrefill:
    """One step's prefill part: its prompt chunks in batch order and what admission promised."""

    budget: PrefillBudget
    chunks: list[tuple[Req, int]] = field(default_factory=list)  # (request, tokens this step)
    reserve: float = 0.0  # slots held back for running and just-admitted requests
    plan: Any = None  # the ratio's plan (SumPlan, adaptive.PeakPlan or FloorPlan) once admitting
    new_seqs: int = 0
    cached: int = 0  # prompt tokens the new requests found in the radix cache

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    def add(self, req: Req, n: int) -> None:
        self.budget.spend(n)
        self.chunks.append((req, n))

    def add_new(self, req: Req, n: int, extend: int, cached: int, reservation: float) -> None:
        """A request just admitted: ``n`` of its ``extend`` uncached prompt tokens run now; the
        rest, and its share of new tokens, are reserved."""
        self.reserve += reservation + (extend - n)
        if self.plan is not None:
            self.plan.admitted(req, extend)
        self.add(req, n)
        self.new_seqs += 1
        self.cached += cached


class Verdict(enum.Enum):
    """What trying to admit one waiting request came to."""

    ADMITTED = "admitted"  # its whole prompt runs this step: try the next
    WAITS = "waits"  # it shares KV with a prompt in flight and waits for it: try the next
    CHUNKED = "chunked"  # admitted with a first chunk: one chunked prompt at a time, so stop
    BATCH_FULL = "batch full"  # --max-running-requests reached: stop
    NO_BUDGET = "no budget"  # the step's prompt-token budget is spent: stop
    NO_ROOM = "no room"  # the KV pool (or its request rows) cannot take it: stop

    @property
    def tries_next(self) -> bool:
        return self is Verdict.ADMITTED or self is Verdict.WAITS


def waits_for_leader(req: Req) -> bool:
    """For n > 1: the samples after the first share its prompt KV once it is cached."""
    leader = req.group_leader
    return leader is not None and not leader.finished and (
        leader.status is not Status.RUNNING or leader.prefilling)


def prefix_in_flight(req: Req, matched: int, chunks) -> bool:
    """Does a prompt being prefilled this step share ``IN_BATCH_PREFIX`` more tokens with
    ``req`` than the cache does? (SGLang's in-batch prefix check.)"""
    if req.seq_len - 1 - matched < IN_BATCH_PREFIX:
        return False
    head = req.tokens(matched, matched + IN_BATCH_PREFIX)
    return any(f.prefilling and f.tokens(matched, matched + IN_BATCH_PREFIX) == head
               for f, _ in chunks)
