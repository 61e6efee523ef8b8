"""What the engine thread sends back for one submitted prompt, and how the HTTP side reads it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Delta:
    """New output of one of a handle's requests (all of it, once, when not streaming)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: Any = None
    completion_tokens: int = 0
    meta: dict | None = None  # Engine.output()'s meta_info, on the last delta
    pieces: dict[int, str] | None = None  # token id -> its text, when the handle wants pieces
    error: str | None = None


class Handle:
    """One submitted prompt (``n`` engine requests) as the HTTP side sees it."""

    def __init__(self, stream: bool = False, want_pieces: bool = False, rid: str | None = None,
                 constraint=None):
        self.stream, self.want_pieces, self.rid = stream, want_pieces, rid
        self.constraint = constraint  # engine.interfaces.Constraint, compiled before submit
        self.reqs: list = []  # filled on the engine thread before submit() returns
        self.prompt_ids: list[int] = []
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        # engine-thread bookkeeping, per request: text / tokens already sent, last token time
        self._sent_text: list[int] = []
        self._sent_ids: list[int] = []
        self._last: list[float | None] = []

    async def deltas(self):
        """Yield deltas until every request has finished."""
        left = len(self.reqs)
        while left:
            delta = await self.queue.get()
            left -= delta.finish_reason is not None
            yield delta

    async def results(self) -> list[Delta]:
        out = [None] * len(self.reqs)
        async for d in self.deltas():
            out[d.index] = d
        return out


# -- built on the engine thread ----------------------------------------------------------------
def stream_delta(engine, handle: Handle, i: int, r) -> Delta:
    """What request ``r`` (the handle's ``i``-th) produced since the last delta."""
    det = r.detokenizer
    if r.finished:
        det.finish()  # flush text held back for a possible stop string
    text, start = det.text, handle._sent_ids[i]
    delta = Delta(i, text[handle._sent_text[i]:], r.output_ids[start:],
                  r.output_logprobs[start:], r.output_top_logprobs[start:],
                  completion_tokens=len(r.output_ids))
    handle._sent_text[i], handle._sent_ids[i] = len(text), len(r.output_ids)
    if r.finished:
        _finish(delta, r, engine.output(r)["meta_info"])
    return delta


def final_delta(engine, i: int, r) -> Delta:
    """All of finished request ``r``'s output in one delta."""
    out = engine.output(r)
    delta = Delta(i, out["text"], list(r.output_ids), list(r.output_logprobs),
                  list(r.output_top_logprobs), completion_tokens=len(r.output_ids))
    _finish(delta, r, out["meta_info"])
    return delta


def _finish(delta: Delta, r, meta: dict) -> None:
    delta.finish_reason, delta.matched_stop, delta.meta = r.finish_reason, r.matched_stop, meta
    delta.error = r.error  # finish reason "error": the request failed (a grammar's error)
