"""The starlette app: the route table, the API-key check, error bodies and the engine's lifespan.

Generation routes live in completions.py, chat.py and generate.py; this file has the small
routes and wires everything together.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import hmac
import logging
import time
from importlib import metadata

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.server import errors
from engine.server.chat import create_chat_completion
from engine.server.completions import create_completion
from engine.server.errors import APIError
from engine.server.generate import generate
from engine.server.handle import Handle
from engine.server.metrics import CONTENT_TYPE_LATEST
from engine.server.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    GenerateOutput,
    GenerateRequest,
    ModelList,
)
from engine.server.openapi import Endpoint, openapi_spec
from engine.server.runtime import EngineFailed
from engine.server.serving import (
    ClientGone,
    ServerSettings,
    ServerState,
    prepare_prompt,
    state,
    submitted,
    to_api_error,
)

HEALTH_GENERATE_TIMEOUT_S = 30.0
logger = logging.getLogger("engine.server")


async def health(request: Request):
    rt = state(request).runtime
    if not rt.alive or rt.draining:
        raise APIError(503, "shutting down" if rt.draining else f"engine down: {rt.failed}")
    return Response(status_code=200)


async def health_generate(request: Request):
    """Generate one token end to end: proves the engine loop is making progress."""
    st = state(request)
    items = [(Handle(), prepare_prompt("ok", {"max_new_tokens": 1, "temperature": 0.0}))]
    try:
        async with submitted(st, items) as (h,):
            results = await asyncio.wait_for(h.results(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(503, f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s") from None
    if results[0].error:
        raise APIError(503, results[0].error)
    return Response(status_code=200)


async def list_models(request: Request):
    st = state(request)
    card = {"id": st.settings.served_model_name, "object": "model", "created": st.created,
            "owned_by": "engine", "root": st.settings.model_path,
            "max_model_len": st.runtime.engine.sizing.context_length}
    return JSONResponse({"object": "list", "data": [card]})


async def metrics(request: Request):
    return Response(state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def server_info(request: Request):
    st = state(request)
    engine, s = st.runtime.engine, st.settings
    sizing = engine.sizing
    info = dataclasses.asdict(engine.config)
    info.update(  # what the engine resolved "auto" and the memory-derived defaults to
        attention_backend=engine.attention_backend, dtype=str(engine.runner.dtype).split(".")[-1],
        quantization=getattr(engine, "quantization", engine.config.quantization),
        device=engine.device.describe(), max_total_tokens=sizing.max_total_tokens,
        max_running_requests=sizing.max_running_requests,
        chunked_prefill_size=sizing.chunked_prefill_size, max_model_len=sizing.context_length,
        mem_fraction_static=sizing.mem_fraction_static)
    info.update(model_path=s.model_path, served_model_name=s.served_model_name, host=s.host,
                port=s.port, api_key="<set>" if s.api_key else None,
                max_request_bytes=s.max_request_bytes,
                shutdown_grace_period=s.shutdown_grace_period,
                architecture=engine.runner.model_config.architecture,
                version=_version(), sizing=sizing.as_dict(), sizing_report=sizing.lines())
    # an MoE model's path: the fused Triton kernel or the per-expert GEMMs, and why
    info["moe_kernel"] = getattr(engine.runner, "moe_kernel", "") or None
    if getattr(engine, "parallel", None) is not None:  # tp x pp ranks: each one's place
        info["parallel"] = engine.runner.info()
    dp = getattr(engine.runner, "dp", None)
    if dp is not None:  # --enable-dp-attention: this rank's place, where its experts are
        place = engine.runner.model.experts_placement
        info["dp_attention"] = {"rank": dp.rank, "size": dp.size, "ep_size": dp.ep_size,
                                "experts_per_rank": place.per_rank,
                                "num_experts": place.num_experts}
    info["prefill_oom_errors"] = engine.scheduler.counters.prefill_oom_errors
    info["available_memory_at_start_gb"] = round(
        getattr(engine, "available_memory", 0) / (1 << 30), 2)
    spec = engine.scheduler.spec  # --speculative-algorithm: its settings and counts
    info["speculative"] = None if spec is None else {**spec.settings.as_dict(),
                                                     **spec.stats.as_dict()}
    try:  # SGLang's key: one entry per engine (one here)
        info["internal_states"] = [await st.runtime.call(internal_state)]
    except EngineFailed as e:
        info["internal_states"] = [{"error": str(e)}]
    try:  # what observers publish (they write on the engine thread: read it there)
        extra = await st.runtime.call(lambda e: copy.deepcopy(e.scheduler.extra_info))
    except EngineFailed:
        extra = copy.deepcopy(engine.scheduler.extra_info)  # no loop left to write to it
    for key, value in extra.items():
        info.setdefault(key, value)  # never over the engine's own keys
    return JSONResponse(info)


def internal_state(engine) -> dict:
    """The scheduler's queues and where every KV slot is, read between two steps. The slots
    add up: free + running + cached = total (and request rows: free + running = total)."""
    scheduler = engine.scheduler
    kv = scheduler.kv
    pool, cache = kv.pool, kv.cache
    used = scheduler.num_used_tokens
    return {"num_running_reqs": len(scheduler.running), "num_queue_reqs": len(scheduler.waiting),
            "num_used_tokens": used, "token_usage": used / pool.size,
            "kv_pool": {"total_slots": pool.size, "free_slots": pool.free_slots,
                        "running_slots": sum(kv.owned_slots(r) for r in scheduler.running),
                        "cached_slots": cache.total_size if cache is not None else 0,
                        "evictable_slots": kv.evictable, "request_rows": pool.max_reqs,
                        "free_request_rows": pool.free_reqs}}


async def flush_cache(request: Request):
    """SGLang's answer: 200 "Cache flushed." when it was, else 400 saying why it was not."""
    def flush(engine):
        scheduler = engine.scheduler
        if scheduler.kv.cache is None:
            return "the radix cache is disabled (--disable-radix-cache); nothing to flush"
        running, queued = len(scheduler.running), len(scheduler.waiting)
        if running or queued:
            logger.warning(f"Cache not flushed because there are pending requests. "
                           f"#queue-req: {queued}, #running-req: {running}")
            raise APIError(400, f"Cache not flushed: {running} request(s) running and "
                                f"{queued} queued; retry when the server is idle.",
                           code="engine_busy")
        if not engine.flush_cache():
            locked = scheduler.kv.cache.protected_size
            logger.warning(f"Cache not flushed: the engine refused ({locked} cached tokens "
                           f"still in use)")
            raise APIError(400, f"Cache not flushed: the engine refused ({locked} cached tokens "
                                f"are still in use); retry when the server is idle.",
                           code="engine_busy")
        return "Cache flushed."

    try:
        message = await state(request).runtime.call(flush)
    except Exception as e:  # noqa: BLE001
        raise to_api_error(e) from None
    return JSONResponse({"message": message})


async def openapi(request: Request):
    return JSONResponse(request.app.state.openapi)


async def client_gone(request: Request, exc: Exception):
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


ENDPOINTS = [
    Endpoint("/v1/completions", ("POST",), create_completion, "OpenAI text completion",
             CompletionRequest, CompletionResponse, streams=True, errors=("404", "503")),
    Endpoint("/v1/chat/completions", ("POST",), create_chat_completion, "OpenAI chat completion",
             ChatCompletionRequest, ChatCompletionResponse, streams=True, errors=("404", "503")),
    Endpoint("/generate", ("POST",), generate, "SGLang-style generation (text or input_ids)",
             GenerateRequest, GenerateOutput, streams=True, errors=("503",)),
    Endpoint("/v1/models", ("GET",), list_models, "The served model", response=ModelList),
    Endpoint("/health", ("GET",), health, "200 while the engine loop runs", public=True,
             errors=("503",)),
    Endpoint("/health_generate", ("GET",), health_generate, "200 once one token is generated",
             errors=("503",)),
    Endpoint("/metrics", ("GET",), metrics, "Prometheus metrics",
             media_type=CONTENT_TYPE_LATEST),
    Endpoint("/get_server_info", ("GET",), server_info, "Every effective setting and the "
                                                         "sizing report"),
    Endpoint("/flush_cache", ("GET", "POST"), flush_cache, "Empty the prefix cache when idle",
             errors=("400", "503")),
    Endpoint("/openapi.json", ("GET",), openapi, "This document"),
]


class APIKeyMiddleware:
    """Every route but the public ones needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_key: str, public: set[str]):
        self.app, self.public = app, public
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.public:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect or missing API key: send 'Authorization: "
                                      "Bearer <key>' (see --api-key)", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(runtime, settings: ServerSettings, metrics) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        runtime.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            runtime.stop()

    routes = [Route(e.path, e.handler, methods=list(e.methods)) for e in ENDPOINTS]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        APIError: errors.api_error_handler, HTTPException: errors.http_exception_handler,
        ClientGone: client_gone, Exception: errors.internal_error_handler})
    app.state.server = ServerState(runtime, settings, metrics, created=int(time.time()))
    app.state.openapi = openapi_spec(ENDPOINTS, "engine", _version(), bool(settings.api_key))
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key,
                           public={e.path for e in ENDPOINTS if e.public})
    return app


def _version() -> str:
    try:
        return metadata.version("engine-core")
    except metadata.PackageNotFoundError:
        return "0"
