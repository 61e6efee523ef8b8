"""The dp front's starlette app: each generation request goes to the replica the routing policy
picks (the Router: router/proxy.py); /flush_cache goes to every replica; /metrics and
/get_server_info report per replica and in total; /health says whether any replica is alive.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.router.aggregate import aggregate
from engine.router.proxy import Router, routing_text  # noqa: F401 - tests import it from here
from engine.server import errors
from engine.server.errors import APIError

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")


def _router(request: Request) -> Router:
    return request.app.state.router


async def proxy(request: Request):
    return await _router(request).forward(request)


async def health(request: Request):
    rt = _router(request)
    rt.set.check_exits()
    if rt.draining or not rt.set.live():
        raise APIError(503, "shutting down" if rt.draining else rt.set.down_reason())
    return Response(status_code=200)


async def passthrough(request: Request):
    return await _router(request).first_live(request.url.path)


async def flush_cache(request: Request):
    """Every live replica flushes; 200 when all did, else the first refusal's status."""
    results = await _router(request).each_live(request.method, "/flush_cache")
    per, status = [], 200
    for r, resp in results.items():
        if isinstance(resp, str):
            per.append({"dp_rank": r.rank, "status": 502, "message": resp})
            status = 502 if status == 200 else status
            continue
        try:
            message = resp.json().get("message") or resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text
        per.append({"dp_rank": r.rank, "status": resp.status_code, "message": message})
        if resp.status_code != 200 and status == 200:
            status = resp.status_code
    if not per:
        raise APIError(503, "no dp replica is alive", code="no_replica")
    if status != 200:
        failed = "; ".join(f"dp rank {p['dp_rank']}: {p['message']}" for p in per
                           if p["status"] != 200)
        return JSONResponse({**APIError(status, failed, code="engine_busy").body(),
                             "replicas": per}, status_code=status)
    return JSONResponse({"message": "Cache flushed.", "replicas": per})


async def metrics(request: Request):
    rt = _router(request)
    results = await rt.each_live("GET", "/metrics")
    texts = {r.rank: resp.text for r, resp in results.items()
             if not isinstance(resp, str) and resp.status_code == 200}
    return Response(aggregate(texts, rt.set.replicas),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


async def server_info(request: Request):
    """The first live replica's settings, with dp_size and the router's, ``replicas``: each
    one's state (and its own /get_server_info while alive), ``internal_states``: one entry per
    live replica (SGLang's key), ``total``: their queues added up."""
    rt = _router(request)
    results = await rt.each_live("GET", "/get_server_info")
    info: dict = {}
    replicas, states, children = [], [], []
    for r in rt.set.replicas:
        entry = {"dp_rank": r.rank, "url": r.url, "pid": r.proc.pid if r.proc else None,
                 "alive": r.alive, "error": r.error, "load": r.load, "routed_requests": r.routed,
                 "restarts": r.restarts}
        resp = results.get(r)
        if resp is not None and not isinstance(resp, str) and resp.status_code == 200:
            child = resp.json()
            info = info or dict(child)
            children.append((r.rank, child))
            entry["internal_state"] = (child.get("internal_states") or [None])[0]
            states.append(entry["internal_state"])
        elif resp is not None:
            entry["error"] = resp if isinstance(resp, str) else f"HTTP {resp.status_code}"
        replicas.append(entry)
    o = rt.options
    info.update(dp_size=o.dp_size, router_policy=rt.policy_name,
                router_balance_abs_threshold=o.balance_abs_threshold,
                router_balance_rel_threshold=o.balance_rel_threshold,
                router_cache_threshold=o.cache_threshold, host=request.app.state.host,
                port=request.app.state.port, replicas=replicas, internal_states=states,
                live_replicas=sum(r.alive for r in rt.set.replicas))
    info["total"] = {key: sum(s.get(key, 0) for s in states if s)
                     for key in ("num_running_reqs", "num_queue_reqs", "num_used_tokens")}
    # counts over every replica (engine doctor reads them), each replica's advice with its rank
    info["prefill_oom_errors"] = sum(c.get("prefill_oom_errors", 0) for _, c in children)
    if any("advice" in c for _, c in children):
        info["advice"] = [{**a, "dp_rank": rank} for rank, c in children
                          for a in c.get("advice") or ()]
    return JSONResponse(info)


def build_front_app(router: Router, host: str, port: int) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        router.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                          limits=httpx.Limits(max_connections=None,
                                                              max_keepalive_connections=64))
        task = asyncio.ensure_future(router.monitor())
        try:
            yield
        finally:
            task.cancel()
            await router.client.aclose()

    routes = [Route(p, proxy, methods=["POST"]) for p in GENERATION_ROUTES]
    routes += [Route("/health", health, methods=["GET"]),
               Route("/health_generate", passthrough, methods=["GET"]),
               Route("/v1/models", passthrough, methods=["GET"]),
               Route("/openapi.json", passthrough, methods=["GET"]),
               Route("/metrics", metrics, methods=["GET"]),
               Route("/get_server_info", server_info, methods=["GET"]),
               Route("/flush_cache", flush_cache, methods=["GET", "POST"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        APIError: errors.api_error_handler, HTTPException: errors.http_exception_handler,
        Exception: errors.internal_error_handler})
    app.state.router, app.state.host, app.state.port = router, host, port
    if router.api_key:
        from engine.server.app import APIKeyMiddleware

        app.add_middleware(APIKeyMiddleware, api_key=router.api_key, public={"/health"})
    return app
