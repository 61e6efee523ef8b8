"""POST /v1/completions: one prompt or a batch, ``n`` choices each, ``echo`` and ``logprobs``
(with echo, the prompt's own token logprobs too, as loglikelihood harnesses need)."""

from __future__ import annotations

import asyncio
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.server.body import read_model
from engine.server.constraints import body_constraint, compile_first
from engine.server.handle import Handle
from engine.server.openai import CompletionRequest
from engine.server.serving import (
    OPENAI_NAMES,
    abort,
    check_model,
    delta_error,
    openai_sampling,
    prepare_prompt,
    state,
    submit,
    submitted,
    unless_disconnected,
    usage,
)
from engine.server.streaming import DONE, EventStream, all_deltas, sse

RENAME = {**OPENAI_NAMES, "top_logprobs": "logprobs"}


async def create_completion(request: Request):
    st = state(request)
    body: CompletionRequest = await read_model(request, CompletionRequest,
                                               st.settings.max_request_bytes)
    check_model(st, body.model)
    p = body.prompt
    prompts = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
    top_n = body.logprobs
    sampling = openai_sampling(body, body.max_tokens, top_n is not None, top_n or 0)
    constraint = body_constraint(body)
    await compile_first(st, constraint)
    # echo + logprobs: the scheduler scores the prompt in its own batches
    scoring = top_n if body.echo and top_n is not None else None
    items = [(Handle(body.stream, top_n is not None, constraint=constraint,
                     prompt_logprobs=scoring), prepare_prompt(x, sampling)) for x in prompts]
    c = _Completion(st, body, prompts)
    if body.stream:
        handles = await submit(st, items, RENAME)
        return EventStream(c.events(handles), on_close=lambda: abort(st, handles))
    async with submitted(st, items, RENAME) as handles:
        results = await unless_disconnected(
            request, asyncio.gather(*(h.results() for h in handles)))
    echo = await c.echo_texts(handles) if body.echo else None
    choices, completion_tokens, cached = [], 0, 0
    for pi, (h, res) in enumerate(zip(handles, results)):
        for j in range(body.n):
            d = res[j] if res else None
            if d is not None and d.error:
                raise delta_error(d)
            choice = c.choice(pi * body.n + j, echo[pi] if echo else None, d)
            choices.append(choice)
            completion_tokens += d.completion_tokens if d else 0
            if d is not None and j == 0:  # the n samples share one prompt
                cached += (d.meta or {}).get("cached_tokens", 0)
    prompt_tokens = sum(len(h.prompt_ids) for h in handles)
    return JSONResponse({**c.header(), "choices": choices,
                         "usage": usage(prompt_tokens, completion_tokens, cached)})


class _Completion:
    def __init__(self, st, body: CompletionRequest, prompts: list):
        self.st, self.body, self.prompts = st, body, prompts
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.offsets: dict[int, int] = {}  # choice index -> text offset of its next token

    def header(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.st.settings.served_model_name}

    async def echo_texts(self, handles: list) -> list[str]:
        """Per prompt, its text (token-id prompts decoded off the engine thread)."""
        tokenizer = self.st.runtime.engine.tokenizer
        return [prompt if isinstance(prompt, str) else
                await asyncio.to_thread(tokenizer.decode, h.prompt_ids)
                for prompt, h in zip(self.prompts, handles)]

    def choice(self, index: int, echo: str | None, d, first: bool = True) -> dict:
        """A choice (or a streamed chunk's choice) from an echo and a delta (None: no tokens);
        with logprobs, the prompt's own come on the delta (``d.prompt``)."""
        text, lp = "", None
        if self.body.logprobs is not None:
            lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if echo is not None and first:
            text = echo
            if lp is not None and d is not None and d.prompt is not None:
                self._add_logprobs(lp, index, *d.prompt, d.pieces)
        if d is not None:
            text += d.text
            if lp is not None:
                self._add_logprobs(lp, index, d.token_ids, d.logprobs, d.top_logprobs, d.pieces)
        reason = d.finish_reason if d is not None else "length"
        out = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        if d is not None and d.finish_reason == "stop":
            out["matched_stop"] = d.matched_stop
        return out

    def _add_logprobs(self, lp: dict, index: int, ids, lps, tops, pieces) -> None:
        offset = self.offsets.get(index, 0)
        for t, logprob, row in zip(ids, lps, tops):
            piece = pieces[t]
            lp["tokens"].append(piece)
            lp["token_logprobs"].append(logprob)
            if logprob is None:
                lp["top_logprobs"].append(None)
            else:
                top = {pieces[i]: v for i, v in row[: self.body.logprobs]}
                top.setdefault(piece, logprob)  # the chosen token is always listed
                lp["top_logprobs"].append(top)
            lp["text_offset"].append(offset)
            offset += len(piece)
        self.offsets[index] = offset

    async def events(self, handles: list):
        body, n = self.body, self.body.n
        echo = await self.echo_texts(handles) if body.echo else None
        pending = {pi * n + j for pi, h in enumerate(handles) for j in range(n)}
        completion_tokens, cached = 0, 0

        async for pi, d in all_deltas(handles):
            index = pi * n + d.index
            if d.error:
                pending.discard(index)
                yield sse(delta_error(d).body())
                continue
            first = index in pending
            if not (first or d.text or d.finish_reason or (body.logprobs is not None
                                                           and d.token_ids)):
                continue  # the detokenizer is holding text back (a partial character or stop)
            pending.discard(index)
            chunk = self.choice(index, echo[pi] if echo else None, d, first)
            if d.finish_reason is None:
                chunk["finish_reason"] = None
            else:
                completion_tokens += d.completion_tokens
                if d.index == 0:  # the n samples share one prompt
                    cached += (d.meta or {}).get("cached_tokens", 0)
            yield sse({**self.header(), "choices": [chunk]})
        for index in sorted(pending):  # max_tokens 0: nothing was generated
            pi = index // n
            yield sse({**self.header(),
                       "choices": [self.choice(index, echo[pi] if echo else None, None)]})
        if body.stream_options is not None and body.stream_options.include_usage:
            prompt_tokens = sum(len(h.prompt_ids) for h in handles)
            yield sse({**self.header(), "choices": [],
                       "usage": usage(prompt_tokens, completion_tokens, cached)})
        yield DONE
