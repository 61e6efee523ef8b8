"""The scheduler's side of structured outputs: which waiting requests may be admitted (their
grammar compiled), the step's bitmask for the constrained rows, and each sampled token
advancing its request's matcher."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait

import torch

from engine.grammar.bitmask import new_bitmask

IDLE_WAIT_S = 0.01  # an idle step waits this long for a compile rather than spin


def admissible(waiting: list) -> list:
    """The waiting requests that can run: unconstrained, or with their grammar compiled (a
    compiling one stays queued and blocks nobody)."""
    return [r for r in waiting if r.grammar is None or not r.grammar.compiling]


def start_matchers(waiting: list) -> list:
    """Give each waiting request whose grammar compiled its matcher; returns those whose compile
    failed (each one's ``error`` set: they must be finished, not run)."""
    failed = [r for r in waiting if r.grammar is not None and not r.grammar.compiling
              and not r.grammar.start()]
    for r in failed:
        r.error = r.grammar.error
    return failed


def wait_for_compiles(waiting: list, timeout: float = IDLE_WAIT_S) -> None:
    """Nothing ran this step: sleep until a compile finishes (at most ``timeout``)."""
    pending = [r.grammar.future for r in waiting if r.grammar is not None and r.grammar.compiling]
    if pending:
        wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)


class StepMasks:
    """Fills one host bitmask per step for the constrained rows (the buffer is reused)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._buffer = new_bitmask(0, vocab_size)

    def fill(self, rows: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row indices, bitmask) for the rows that carry a matcher, or None when none does."""
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not constrained:
            return None
        if self._buffer.shape[0] < len(constrained):
            self._buffer = new_bitmask(max(len(constrained), 2 * self._buffer.shape[0]),
                                       self.vocab_size)
        bitmask = self._buffer[: len(constrained)]
        bitmask.zero_()
        for k, i in enumerate(constrained):
            rows[i].grammar.matcher.fill_bitmask(bitmask, k)
        return torch.tensor(constrained, dtype=torch.long), bitmask


def advance(r, token: int) -> str | None:
    """Advance ``r``'s matcher past ``token``: "error" when the backend rejects it (``r.error``
    says so), "stop" when the grammar is complete, else None."""
    g = r.grammar
    if not g.accept(token):
        r.error = g.error
        return "error"
    return "stop" if g.terminated else None
