"""POST /v1/chat/completions: the tokenizer's chat template (rendered in a bounded sandbox on a
tokenizer thread: engine.server.templates), ``n`` choices, logprobs, SSE; tools and
tool_choice (engine.server.tool_choice), each choice's reasoning, content and tool calls
(engine.server.chat_output)."""

from __future__ import annotations

import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.server.body import read_model
from engine.server.chat_output import ChoiceOutput
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
from engine.server.tool_choice import ChatTools, chat_tools


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
                 template: str | None = None, tools: list[dict] | None = None):
    """Runs on a tokenizer thread (EngineRuntime.submit): render, tokenize, sampling params."""
    def run(engine):
        try:
            text = templates.render(messages, add_generation_prompt, template, template_kwargs,
                                    tools=tools)
        except ChatTemplateError as e:
            raise bad_request(str(e), param=e.param, code=e.limit and
                              f"chat_template_{e.limit}_limit") from None
        # the template already wrote the special tokens (BOS) it wants
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        return ids, engine_params(engine, ids, sampling)
    return run


def _message(m) -> dict:
    """A message as the template gets it: an earlier call's arguments as a dict (templates
    write them with tojson, as SGLang and vLLM pass them), a tool result's tool_call_id."""
    content = m.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    out = {"role": m.role, "content": content or ""}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    if m.tool_calls:
        out["tool_calls"] = [{**({"id": c.id} if c.id is not None else {}), "type": c.type,
                              "function": {"name": c.function.name,
                                           "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    return out


def _arguments(arguments):
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


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
    constraint = body_constraint(body)
    tools = chat_tools(st.runtime.engine, body, constraint)
    constraint = constraint or tools.constraint
    if tools.keep_special_tokens:  # the parser's markers are special tokens
        sampling["skip_special_tokens"] = False
    prepare = prepare_chat(templates, [_message(m) for m in body.messages], sampling,
                           body.add_generation_prompt, body.chat_template_kwargs,
                           body.chat_template, tools.template_tools)
    await compile_first(st, constraint)
    items = [(Handle(body.stream, body.logprobs, constraint=constraint), prepare)]
    chat = _Chat(st, body, tools)
    if body.stream:
        handles = await submit(st, items, OPENAI_NAMES)
        return EventStream(chat.events(handles[0]), on_close=lambda: abort(st, handles))
    async with submitted(st, items, OPENAI_NAMES) as (h,):
        results = await unless_disconnected(request, h.results()) if h.reqs else []
    choices = []
    for d in results:
        if d.error:
            raise delta_error(d)
        out = chat.output()
        out.feed(d.text)
        out.finish()
        choice = {"index": d.index, "message": out.message(), "logprobs": chat.logprobs(d),
                  "finish_reason": finish_reason(out, d)}
        if choice["finish_reason"] == "stop":
            choice["matched_stop"] = d.matched_stop
        choices.append(choice)
    completion = sum(d.completion_tokens for d in results)
    cached = sum((d.meta or {}).get("cached_tokens", 0) for d in results[:1])
    return JSONResponse({**chat.header("chat.completion"), "choices": choices,
                         "usage": usage(len(h.prompt_ids), completion, cached)})


def finish_reason(out: ChoiceOutput, d) -> str | None:
    """"tool_calls" when the output ended (not cut) with well-formed calls."""
    return "tool_calls" if d.finish_reason == "stop" and out.called else d.finish_reason


class _Chat:
    def __init__(self, st, body: ChatCompletionRequest, tools: ChatTools):
        self.st, self.body, self.tools = st, body, tools
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def output(self) -> ChoiceOutput:
        """A choice's reader of its output (its own parsers)."""
        t = self.tools
        return ChoiceOutput(t.reasoning_parser() if t.reasoning_parser else None,
                            t.tool_parser() if t.tool_parser else None,
                            stream_reasoning=self.body.stream_reasoning)

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
        outputs = [self.output() for _ in h.reqs]
        async for d in h.deltas():
            if d.error:
                yield sse(delta_error(d).body())
                continue
            out = outputs[d.index]
            deltas = out.feed(d.text)
            if d.finish_reason is not None:
                deltas += out.finish()
            elif not deltas and not (self.body.logprobs and d.token_ids):
                continue  # held back: a partial character or stop, a parser's marker
            for k, delta in enumerate(deltas or [{}]):  # the last one carries finish_reason
                last = k == max(len(deltas), 1) - 1
                choice = {"index": d.index, "delta": delta,
                          "logprobs": self.logprobs(d) if d.token_ids and not k else None,
                          "finish_reason": None}
                if last and d.finish_reason is not None:
                    completion += d.completion_tokens
                    cached = cached or (d.meta or {}).get("cached_tokens", 0)
                    choice["finish_reason"] = finish_reason(out, d)
                    if choice["finish_reason"] == "stop":
                        choice["matched_stop"] = d.matched_stop
                yield chunk(choice)
        if with_usage:
            yield sse({**self.header("chat.completion.chunk"), "choices": [],
                       "usage": usage(len(h.prompt_ids), completion, cached)})
        yield DONE
