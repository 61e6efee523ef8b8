"""POST /v1/chat/completions: the tokenizer's chat template (rendered in a bounded sandbox on a
tokenizer thread: engine.server.templates), ``n`` choices, logprobs, SSE."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.server.body import read_model
from engine.server.constraints import body_constraint, compile_first
from engine.server.errors import bad_request
from engine.server.handle import Handle
from engine.server.openai import ChatCompletionRequest
from engine.server.serving import (
    OPENAI_NAMES,
    abort,
    check_model,
    delta_error,
    engine_params,
    openai_sampling,
    state,
    submit,
    submitted,
    unless_disconnected,
    usage,
)
from engine.server.streaming import DONE, EventStream, sse
from engine.server.templates import ChatTemplateError, ChatTemplates


def chat_templates(st) -> ChatTemplates:
    """The server's ChatTemplates (made at the first chat request)."""
    if st.templates is None:
        engine = st.runtime.engine
        st.templates = ChatTemplates(
            engine.tokenizer,
            trust_request_template=bool(getattr(engine.config, "trust_request_chat_template",
                                                False)),
            context_length=engine.sizing.context_length)
    return st.templates


def prepare_chat(templates: ChatTemplates, messages: list[dict], sampling: dict,
                 add_generation_prompt: bool, template_kwargs: dict | None,
                 template: str | None = None):
    """Runs on a tokenizer thread (EngineRuntime.submit): render, tokenize, sampling params."""
    def run(engine):
        try:
            text = templates.render(messages, add_generation_prompt, template, template_kwargs)
        except ChatTemplateError as e:
            raise bad_request(str(e), param=e.param, code=e.limit and
                              f"chat_template_{e.limit}_limit") from None
        # the template already wrote the special tokens (BOS) it wants
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        return ids, engine_params(engine, ids, sampling)
    return run


def _message(m) -> dict:
    content = m.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    out = {"role": m.role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    return out


async def create_chat_completion(request: Request):
    st = state(request)
    body: ChatCompletionRequest = await read_model(request, ChatCompletionRequest,
                                                   st.settings.max_request_bytes)
    check_model(st, body.model)
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    sampling = openai_sampling(body, max_new, body.logprobs, body.top_logprobs or 0)
    templates = chat_templates(st)
    try:  # a template sent with the request: refused unless --trust-request-chat-template
        templates.check_request(body.chat_template, body.chat_template_kwargs)
    except ChatTemplateError as e:
        raise bad_request(str(e), param=e.param, code="chat_template_not_allowed") from None
    prepare = prepare_chat(templates, [_message(m) for m in body.messages], sampling,
                           body.add_generation_prompt, body.chat_template_kwargs,
                           body.chat_template)
    constraint = body_constraint(body)
    await compile_first(st, constraint)
    items = [(Handle(body.stream, body.logprobs, constraint=constraint), prepare)]
    chat = _Chat(st, body)
    if body.stream:
        handles = await submit(st, items, OPENAI_NAMES)
        return EventStream(chat.events(handles[0]), on_close=lambda: abort(st, handles))
    async with submitted(st, items, OPENAI_NAMES) as (h,):
        results = await unless_disconnected(request, h.results()) if h.reqs else []
    choices = []
    for d in results:
        if d.error:
            raise delta_error(d)
        choice = {"index": d.index, "message": {"role": "assistant", "content": d.text},
                  "logprobs": chat.logprobs(d), "finish_reason": d.finish_reason}
        if d.finish_reason == "stop":
            choice["matched_stop"] = d.matched_stop
        choices.append(choice)
    completion = sum(d.completion_tokens for d in results)
    cached = sum((d.meta or {}).get("cached_tokens", 0) for d in results[:1])
    return JSONResponse({**chat.header("chat.completion"), "choices": choices,
                         "usage": usage(len(h.prompt_ids), completion, cached)})


class _Chat:
    def __init__(self, st, body: ChatCompletionRequest):
        self.st, self.body = st, body
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.st.settings.served_model_name}

    def logprobs(self, d) -> dict | None:
        if not self.body.logprobs:
            return None
        content = []
        for t, lp, row in zip(d.token_ids, d.logprobs, d.top_logprobs):
            piece = d.pieces[t]
            top = [{"token": d.pieces[i], "logprob": v, "bytes": list(d.pieces[i].encode())}
                   for i, v in row]
            content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                            "top_logprobs": top})
        return {"content": content}

    async def events(self, h: Handle):
        with_usage = self.body.stream_options is not None and \
            self.body.stream_options.include_usage
        extra = {"usage": None} if with_usage else {}

        def chunk(choice: dict) -> bytes:
            return sse({**self.header("chat.completion.chunk"), "choices": [choice], **extra})

        for i in range(len(h.reqs)):
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
        completion, cached = 0, 0
        async for d in h.deltas():
            if d.error:
                yield sse(delta_error(d).body())
                continue
            if not d.text and d.finish_reason is None and not (self.body.logprobs and
                                                                d.token_ids):
                continue  # the detokenizer is holding text back (a partial character or stop)
            choice = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                      "logprobs": self.logprobs(d) if d.token_ids else None,
                      "finish_reason": d.finish_reason}
            if d.finish_reason is not None:
                completion += d.completion_tokens
                cached = cached or (d.meta or {}).get("cached_tokens", 0)
                if d.finish_reason == "stop":
                    choice["matched_stop"] = d.matched_stop
            yield chunk(choice)
        if with_usage:
            yield sse({**self.header("chat.completion.chunk"), "choices": [],
                       "usage": usage(len(h.prompt_ids), completion, cached)})
        yield DONE
