"""What the engine thread sends back for one submitted prompt, and how the HTTP side reads it.

Per step the engine thread only hands over, per request, how many output tokens it has and
whether it finished (``Step``); the detokenizer thread (engine.server.detokenize) slices the new
tokens (``collect``), turns them into Deltas with their text (``build_delta``) and hands them to
the event loop."""

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
    # on a request's first delta when its prompt was scored (echo + logprobs): (prompt ids,
    # their logprobs (None first), their top (token, logprob) lists)
    prompt: tuple[list[int], list, list] | None = None


class Handle:
    """One submitted prompt (``n`` engine requests) as the HTTP side sees it."""

    def __init__(self, stream: bool = False, want_pieces: bool = False, rid: str | None = None,
                 constraint=None, prompt_logprobs: int | None = None):
        self.stream, self.want_pieces, self.rid = stream, want_pieces, rid
        self.constraint = constraint  # engine.interfaces.Constraint, compiled before submit
        # score the prompt's own tokens with that many top entries (echo + logprobs); the
        # first request computes them, the others share them (scheduler/prompt_logprobs.py)
        self.prompt_logprobs = prompt_logprobs
        self.reqs: list = []  # filled on the engine thread before submit() returns
        self.prompt_ids: list[int] = []
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        # the detokenizer thread's state (only it reads and writes these), per request: output
        # tokens already sent, when its last token came (inter-token latency), its
        # IncrementalDetokenizer (streams; one with stop strings applies them to the text, as
        # the engine side's Req.detokenizer does to decide where the request stops)
        self.sent: list[int] = []
        self.last_token_time: list[float | None] = []
        self.detokenizers: list = []

    def started(self, reqs: list) -> None:
        """Engine thread, once ``reqs`` are queued: per-request bookkeeping."""
        self.reqs = reqs
        n = len(reqs)
        self.sent, self.last_token_time, self.detokenizers = [0] * n, [None] * n, [None] * n

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


# -- what the engine thread hands over per step: no slices, no text ---------------------------
# Per request that got a token or finished in a step, the engine thread (EngineRuntime._publish)
# hands the detokenizer thread a plain tuple (the cheapest object to make, 256 of them a step):
#   ((handle, index), req, number of output tokens, finished)
# Its lists only grow, so the detokenizer thread slices what the step added itself (``collect``)
# and, for a request with stop strings, applies them to the text with its own detokenizer (the
# engine side only decides at which token the request stops: Req.detokenizer.check).
Step = tuple

# What ``collect`` makes of one, for ``build_delta``: a plain tuple of
#   (handle, index, req, token_ids, logprobs, top_logprobs, completion_tokens, text, finished,
#    prompt)
# where ``text`` is already made text (None: build_delta decodes token_ids) and ``prompt`` is
# Delta.prompt.
Out = tuple


def collect(handle: Handle, i: int, r, n: int, finished: bool) -> Out | None:
    """Detokenizer thread: what request ``r`` (the handle's ``i``-th), with ``n`` output tokens
    and ``finished`` as the engine thread saw it after a step, has to send, or None (a request
    that does not stream sends once, when it finished). Slices of the new tokens only."""
    if not handle.stream:
        if not finished:
            return None
        # finished: nothing changes it any more; read it as it is
        return (handle, i, r, r.output_ids, r.output_logprobs, r.output_top_logprobs,
                len(r.output_ids), None, True, scored_prompt(handle))
    sent = handle.sent
    start = sent[i]
    sent[i] = n
    if r.params.logprobs:
        lps, tops = r.output_logprobs[start:n], r.output_top_logprobs[start:n]
    else:
        lps = tops = _EMPTY
    return (handle, i, r, r.output_ids[start:n], lps, tops, n, None, finished,
            scored_prompt(handle) if start == 0 else None)


_EMPTY: list = []  # never written to: the logprobs of a request that asked for none


# -- made on the detokenizer thread ---------------------------------------------------------------
def build_delta(engine, o: Out, pieces=None) -> Delta:
    """The Delta of ``o``: streamed text from the request's incremental detokenizer (O(1) per
    token: a window of the last few tokens), or the finished request's whole text at once."""
    from engine.sampling import IncrementalDetokenizer

    h, i, r, token_ids, logprobs, top_logprobs, completion_tokens, text, finished, prompt = o
    if h.stream:
        if text is None:
            det = h.detokenizers[i]
            if det is None:
                det = h.detokenizers[i] = IncrementalDetokenizer(engine.tokenizer,
                                                                 h.prompt_ids, r.params)
            ids = token_ids
            if finished and ids and r.finish_reason == "stop" and isinstance(r.matched_stop,
                                                                             int):
                ids = ids[:-1]  # a final EOS / stop token id shows no text (Engine.output)
            elif finished and ids and r.finish_reason == "error" and r.detokenizer is not None:
                ids = ids[:-1]  # the token a grammar rejected: out of Engine.output's text too
            text = det.add(ids) if ids else ""
            if finished:
                text += det.finish()
        if logprobs is _EMPTY:
            logprobs, top_logprobs = [], []
        delta = Delta(i, text, token_ids, logprobs, top_logprobs,
                      completion_tokens=completion_tokens)
    else:
        delta = Delta(i, engine.output_text(r), list(r.output_ids), list(r.output_logprobs),
                      list(r.output_top_logprobs), completion_tokens=len(r.output_ids))
    delta.prompt = prompt
    if finished:
        _finish(delta, r, engine.meta_info(r))
    if h.want_pieces and pieces is not None:
        ids = [*delta.token_ids, *(t for row in delta.top_logprobs for t, _ in row)]
        if delta.prompt is not None:
            ids += [*delta.prompt[0], *(t for row in delta.prompt[2] if row for t, _ in row)]
        delta.pieces = pieces(ids)
    return delta


def scored_prompt(handle: Handle) -> tuple | None:
    """The handle's prompt logprobs, computed by its first request (the others of an ``n``
    group are admitted only once its prompt ran, so they are complete by their first token)."""
    if handle.prompt_logprobs is None or not handle.reqs:
        return None
    leader = handle.reqs[0]
    return list(leader.prompt_ids), list(leader.input_logprobs), list(leader.input_top_logprobs)


def _finish(delta: Delta, r, meta: dict) -> None:
    delta.finish_reason, delta.matched_stop, delta.meta = r.finish_reason, r.matched_stop, meta
    delta.error = r.error  # finish reason "error": the request failed (a grammar's error)
