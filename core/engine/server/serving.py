"""What the generation routes share: server state, the model-name check, turning a request into
engine work (prepared on a tokenizer thread, never the engine thread) and engine errors into
HTTP errors."""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass

from starlette.requests import Request

from engine.engine import RequestError
from engine.sampling import SamplingParamsError
from engine.server.errors import APIError, bad_request, overloaded
from engine.server.runtime import EngineFailed, QueueFull, ShuttingDown

# OpenAI names of SamplingParams fields, for error messages
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


@dataclass
class ServerSettings:
    model_path: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_request_bytes: int = 32 << 20
    shutdown_grace_period: float = 30.0
    record_trace: str | None = None  # JSONL file: a line per finished request


@dataclass
class ServerState:
    runtime: object  # EngineRuntime
    settings: ServerSettings
    metrics: object  # ServerMetrics
    created: int = 0
    templates: object = None  # engine.server.templates.ChatTemplates, made at first use


def state(request: Request) -> ServerState:
    return request.app.state.server


def check_model(st: ServerState, name: str | None) -> None:
    s = st.settings
    if name is not None and name not in (s.served_model_name, s.model_path):
        raise APIError(404, f"The model '{name}' does not exist; this server serves "
                            f"'{s.served_model_name}'.", param="model", code="model_not_found")


def engine_params(engine, ids: list[int], sampling: dict):
    """SamplingParams for a tokenized prompt; max_new_tokens None means up to the context."""
    d = dict(sampling)
    if d.get("max_new_tokens") is None:
        sizing = engine.sizing
        d["max_new_tokens"] = max(min(sizing.context_length, sizing.max_total_tokens) - len(ids), 1)
    return engine.make_params(d)


def openai_sampling(body, max_new_tokens: int | None, logprobs: bool, top_logprobs: int) -> dict:
    """SamplingParams fields from the OpenAI fields (and the SGLang/vLLM extensions)."""
    d = {"max_new_tokens": max_new_tokens, "min_new_tokens": body.min_tokens,
         "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
         "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
         "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty,
         "seed": body.seed, "stop": body.stop, "stop_token_ids": body.stop_token_ids,
         "ignore_eos": body.ignore_eos, "skip_special_tokens": body.skip_special_tokens,
         "n": body.n, "logprobs": logprobs, "top_logprobs": top_logprobs}
    return {k: v for k, v in d.items() if v is not None}


def prepare_prompt(prompt: str | list[int], sampling: dict):
    """Runs on a tokenizer thread (EngineRuntime.submit): tokenize, sampling params."""
    def run(engine):
        ids = engine.tokenize(prompt)
        return ids, engine_params(engine, ids, sampling)
    return run


def to_api_error(exc: Exception, rename: dict | None = None) -> Exception:
    """The HTTP error for an engine-side exception (unknown ones are returned unchanged);
    ``rename`` maps SamplingParams field names to the route's own."""
    names = rename or {}

    def openai_words(text: str) -> str:
        if not names:
            return text
        return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: names[m.group(1)], text)

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SamplingParamsError):
        return bad_request(openai_words(str(exc)), param=names.get(exc.field, exc.field),
                           code="invalid_value")
    if isinstance(exc, RequestError):
        code = "context_length_exceeded" if "context length" in str(exc) else "invalid_prompt"
        return bad_request(openai_words(str(exc)), code=code)
    if isinstance(exc, (QueueFull, ShuttingDown)):
        return overloaded(str(exc))
    if isinstance(exc, EngineFailed):
        return APIError(503, str(exc), code="engine_unavailable")
    return exc


async def submit(st: ServerState, items: list, rename: dict | None = None) -> list:
    """Submit ``[(Handle, prepare)]`` (all or none); returns the handles. The caller must
    ``abort()`` them when it stops listening, so that a client that went away frees its slots."""
    try:
        await st.runtime.submit(items)
    except Exception as e:  # noqa: BLE001 - mapped, or re-raised as is
        raise to_api_error(e, rename) from None
    return [h for h, _ in items]


def abort(st: ServerState, handles: list) -> None:
    for h in handles:
        st.runtime.abort(h)


@contextlib.asynccontextmanager
async def submitted(st: ServerState, items: list, rename: dict | None = None):
    """``submit()``, and abort whatever is unfinished when the block exits."""
    try:
        yield await submit(st, items, rename)
    finally:
        abort(st, [h for h, _ in items])


async def unless_disconnected(request: Request, awaitable):
    """Await ``awaitable``, cancelling it if the client disconnects first (then raise
    ClientGone). The body has been read, so the next ASGI message can only be a disconnect."""
    task = asyncio.ensure_future(awaitable)

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone()


class ClientGone(Exception):
    pass


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def delta_error(delta) -> APIError:
    return APIError(503 if delta.finish_reason == "abort" else 500, delta.error)
