"""The dp front's proxying: the Router picks the replica the routing policy chooses for each
generation request and forwards it, streaming or buffered, and fans a request out to every live
replica (/flush_cache, /metrics, /get_server_info).

A replica found dead (its process exited, or it refuses connections) is taken out of rotation;
a request not yet sent moves to another replica, one already answered in part ends with a 502
(an SSE error event when streaming), never a hang. The client hanging up closes the connection
to the replica, whose own disconnect detection aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.router.policy import ReplicaView, RouterOptions
from engine.router.replicas import Replica, ReplicaSet
from engine.server.body import read_body
from engine.server.errors import APIError

logger = logging.getLogger("engine.router")
CHECK_INTERVAL_S = 0.5
EXIT_WAIT_S = 2.0  # after a broken connection, how long to wait for the replica's exit
_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}


def routing_text(body: bytes) -> str:
    """What the policy matches on: the prompt, the messages or the input ids, as text."""
    try:
        obj = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(obj, dict):
        return ""
    for key in ("prompt", "messages", "text", "input_ids"):
        if key in obj:
            value = obj[key]
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return ""


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e) or 'connection lost'}"


async def _disconnected(receive) -> None:
    """Returns once the client has hung up (the body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel(task: asyncio.Future) -> None:
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


def _client_gone(r: Replica, request: Request) -> Response:
    logger.info(f"{request.url.path}: the client hung up; the request is aborted on dp rank "
                f"{r.rank} (its connection closed)")
    return Response(status_code=499)  # nginx's "client closed request": no one reads it


class Router:
    def __init__(self, replicas: ReplicaSet, policy, options: RouterOptions, policy_name: str,
                 api_key: str | None, max_request_bytes: int = 32 << 20):
        self.set, self.policy, self.options = replicas, policy, options
        self.policy_name, self.api_key = policy_name, api_key
        self.max_request_bytes = max_request_bytes  # --max-request-bytes: 413 past it
        self.client: httpx.AsyncClient | None = None
        self.draining = False
        self.forgotten: set[int] = set()  # dead ranks the policy was told about

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def kill(self, r: Replica, reason: str) -> None:
        r.mark_dead(reason)
        self.forget_dead()

    def forget_dead(self) -> None:
        """Tell the policy, once, about each replica that died."""
        for r in self.set.replicas:
            if not r.alive and r.rank not in self.forgotten:
                self.forgotten.add(r.rank)
                self.policy.remove(r.rank)

    def pick(self, text: str) -> Replica:
        self.set.check_exits()
        self.forget_dead()
        live = self.set.live()
        if not live:
            raise APIError(503, self.set.down_reason(), code="no_replica")
        views = [ReplicaView(r.rank, r.load) for r in live]
        rank = self.policy.choose(text, views)
        chosen = next((r for r in live if r.rank == rank), None)
        if chosen is None:
            raise RuntimeError(f"routing policy {self.policy_name!r} chose dp rank {rank}, "
                               f"which is not a live replica ({[r.rank for r in live]})")
        return chosen

    async def monitor(self) -> None:
        """Notices deaths, restarts dead replicas (ReplicaSet's backoff) and puts a replica
        back into rotation once its /health answers 200."""
        while True:
            self.set.check_exits()
            self.forget_dead()
            if not self.draining:
                self.set.restart_due()
                await asyncio.gather(*(self._probe(r) for r in self.set.recovering()))
            await asyncio.sleep(CHECK_INTERVAL_S)

    async def _probe(self, r: Replica) -> None:
        try:
            resp = await self.client.get(r.url + "/health", timeout=2.0)
        except httpx.HTTPError:
            return
        if resp.status_code == 200 and r.proc.poll() is None:
            r.mark_healthy()
            self.forgotten.discard(r.rank)  # its next death is told to the policy again

    async def forward(self, request: Request) -> Response:
        if self.draining:
            raise APIError(503, "shutting down")
        body = await read_body(request, self.max_request_bytes)  # 413 past the limit
        text = routing_text(body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers.update(self.headers)
        # the client hanging up ends the request on the replica too: the connection to it closes
        # and the replica's own disconnect detection aborts the request
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            while True:
                r = self.pick(text)
                req = self.client.build_request(request.method, r.url + request.url.path,
                                                params=request.query_params, content=body,
                                                headers=headers)
                r.load += 1
                sending = asyncio.ensure_future(self.client.send(req, stream=True))
                try:
                    await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not sending.done():
                        await _cancel(sending)
                        r.load -= 1
                        return _client_gone(r, request)
                    upstream = sending.result()
                except httpx.ConnectError as e:  # refused: nothing listens there
                    r.load -= 1
                    self.kill(r, f"connection failed: {type(e).__name__}: {e}")
                    continue  # nothing was sent: the request moves to another replica
                except httpx.HTTPError as e:
                    r.load -= 1
                    if await asyncio.to_thread(self.set.exited, r, EXIT_WAIT_S):
                        continue  # it died before answering: the request moves to another
                    raise APIError(502, f"dp rank {r.rank} failed before answering this "
                                        f"request ({_describe(e)}); retry it",
                                   code="replica_failed", type="bad_gateway") from None
                except BaseException:
                    await _cancel(sending)
                    r.load -= 1
                    raise
                r.routed += 1
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    await _cancel(gone)  # StreamingResponse watches for the hang-up itself
                    return self._stream(r, upstream)
                return await self._buffered(r, upstream, gone, request)
        finally:
            await _cancel(gone)

    def _stream(self, r: Replica, upstream: httpx.Response) -> Response:
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}

        async def body():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                self.set.check_exits()
                msg = (f"dp rank {r.rank} failed while answering this request "
                       f"({_describe(e)}); retry it")
                logger.error(msg)
                yield b"data: " + json.dumps(APIError(502, msg, code="replica_failed")
                                             .body()).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                r.load -= 1
                await upstream.aclose()

        return StreamingResponse(body(), status_code=upstream.status_code, headers=out_headers)

    async def _buffered(self, r: Replica, upstream: httpx.Response, gone: asyncio.Future,
                        request: Request) -> Response:
        """A non-streaming answer: read whole before the status goes out, so that a replica
        dying mid-answer becomes a 502 instead of a truncated body; the client hanging up
        meanwhile closes the connection to the replica (which aborts the request)."""
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        reading = asyncio.ensure_future(upstream.aread())
        try:
            await asyncio.wait({reading, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not reading.done():
                await _cancel(reading)
                return _client_gone(r, request)
            content = reading.result()
        except httpx.HTTPError as e:
            self.set.check_exits()
            msg = (f"dp rank {r.rank} failed while answering this request "
                   f"({_describe(e)}); retry it")
            logger.error(msg)
            raise APIError(502, msg, code="replica_failed", type="bad_gateway") from None
        finally:
            await _cancel(reading)
            r.load -= 1
            await upstream.aclose()
        return Response(content, upstream.status_code, headers=out_headers)

    async def first_live(self, path: str) -> Response:
        for r in self.set.live():
            try:
                resp = await self.client.get(r.url + path, headers=self.headers)
            except httpx.ConnectError as e:
                self.kill(r, f"connection failed: {e}")
                continue
            return Response(resp.content, resp.status_code,
                            media_type=resp.headers.get("content-type"))
        raise APIError(503, self.set.down_reason(), code="no_replica")

    async def each_live(self, method: str, path: str) -> dict[Replica, httpx.Response | str]:
        async def one(r):
            try:
                return await self.client.request(method, r.url + path, headers=self.headers)
            except httpx.HTTPError as e:
                self.set.check_exits()
                return f"{type(e).__name__}: {e}"
        live = self.set.live()
        return dict(zip(live, await asyncio.gather(*(one(r) for r in live))))
