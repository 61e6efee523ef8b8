"""The server's failure paths, each with a fault injected into an engine served in this process
(engine_testing.servers.InProcessServer: `engine serve`'s own server on 127.0.0.1, a real HTTP
client): an exception inside a step, a failed step that leaves KV slots behind, steps failing again
and again, the engine loop dying, a request arriving while draining, requests aborted while still
queued, and /flush_cache refused.

Every engine here runs its steps at least STEP_S apart, so that requests are still in flight
when the test acts, however fast the machine.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from engine_testing.servers import InProcessServer

STEP_S = 0.004
LONG = 400  # tokens: at least 1.6 s of steps


@pytest.fixture
def serve(tiny_model_factory, single_torch_thread, in_process_server):
    """``serve(**engine_kwargs) -> InProcessServer`` (started; stopped after the test)."""
    from engine import Engine

    def start(**kwargs) -> InProcessServer:
        kwargs.setdefault("max_total_tokens", 2048)
        engine = Engine(tiny_model_factory("llama"), **kwargs)
        real_step = engine.step

        def step():
            time.sleep(STEP_S)
            return real_step()

        engine.step = step
        return in_process_server(engine)

    return start


def fail_next_step(engine, error: BaseException | None = None, before=None) -> threading.Event:
    """Make ``engine``'s next step (once the returned event is set) run ``before(engine)`` and
    raise ``error``; later steps run normally."""
    armed, real_step = threading.Event(), engine.step

    def step():
        if armed.is_set():
            armed.clear()
            if before is not None:
                before(engine)
            raise error or RuntimeError("injected fault")
        return real_step()

    engine.step = step
    return armed


def wait_health(server, status: int, timeout: float = 10) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (health := httpx.get(server.url + "/health", timeout=10)).status_code != status:
        assert time.monotonic() < deadline, f"/health still answers {health.status_code}"
        time.sleep(0.02)
    return health


def internal_state(server) -> dict:
    r = httpx.get(server.url + "/get_server_info", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["internal_states"][0]


def assert_all_free(state: dict, cached: int | None = 0) -> None:
    """Nothing running or queued, and every KV slot and request row back (``cached`` slots, or
    any number when None, held by the prefix cache)."""
    pool = state["kv_pool"]
    assert state["num_running_reqs"] == state["num_queue_reqs"] == 0, state
    assert state["num_used_tokens"] == 0 and pool["running_slots"] == 0, state
    assert pool["free_slots"] + pool["cached_slots"] == pool["total_slots"], state
    assert pool["free_request_rows"] == pool["request_rows"], state
    if cached is not None:
        assert pool["cached_slots"] == cached, state


async def wait_state(http: httpx.AsyncClient, server, ok, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = (await http.get(server.url + "/get_server_info")).json()["internal_states"][0]
        if ok(state):
            return state
        assert time.monotonic() < deadline, state
        await asyncio.sleep(0.01)


async def stream(http: httpx.AsyncClient, url: str, body: dict, first: asyncio.Event | None = None):
    """The non-empty SSE lines of one streamed request; ``first`` is set at the first one."""
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        lines = []
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
                if first is not None:
                    first.set()
        return lines


def stream_error(lines: list[str]) -> dict:
    """The error a stream ended with (its last event before [DONE])."""
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return json.loads(lines[-2][len("data: "):])["error"]


def completion(prompt: str, max_tokens: int = LONG, **fields) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **fields}


async def three_in_flight(http, server):
    """A streamed completion, a streamed chat and a plain /generate, all running; returns their
    tasks (two lists of SSE lines and one response)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
            "ignore_eos": True, "stream": True}
    tasks = [asyncio.ensure_future(stream(http, server.url + "/v1/completions",
                                          completion("one", stream=True))),
             asyncio.ensure_future(stream(http, server.url + "/v1/chat/completions", chat)),
             asyncio.ensure_future(http.post(server.url + "/generate", json={
                 "text": "three", "sampling_params": {"max_new_tokens": LONG,
                                                      "ignore_eos": True}}))]
    await wait_state(http, server, lambda s: s["num_running_reqs"] == 3)
    return tasks


def fire_while_three_run(s, armed):
    """Three requests in flight, then the armed fault: their (stream lines, stream lines,
    plain response)."""
    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = await three_in_flight(http, s)
            armed.set()
            return await asyncio.gather(*tasks)

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_an_exception_in_a_step_fails_every_request_in_flight_and_serving_goes_on(serve):
    s = serve()
    armed = fail_next_step(s.engine)

    completion_lines, chat_lines, plain = fire_while_three_run(s, armed)
    for error in (stream_error(completion_lines), stream_error(chat_lines),
                  plain.json()["error"]):
        assert error["type"] == "internal_server_error", error
        assert "internal error in the engine step (RuntimeError: injected fault)" in \
            error["message"], error
    assert plain.status_code == 500
    # the failed step's leftovers are gone, the prefix cache included
    assert_all_free(internal_state(s), cached=0)
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    r = httpx.post(s.url + "/v1/completions", json=completion("after", 4), timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_a_failed_step_that_leaves_kv_slots_behind_takes_the_engine_down(serve):
    s = serve()
    leaked = []
    armed = fail_next_step(s.engine, before=lambda e: leaked.append(
        e.scheduler.kv.pool.alloc_pages(1)))  # a bug that loses a page, then raises

    completion_lines, _, plain = fire_while_three_run(s, armed)
    assert "injected fault" in stream_error(completion_lines)["message"]
    assert plain.status_code == 500 and leaked
    health = wait_health(s, 503)  # the verdict follows the errors sent to the clients
    assert "the KV pool did not come back after the failed step" in \
        health.json()["error"]["message"]
    r = httpx.post(s.url + "/v1/completions", json=completion("after", 4), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert "the engine cannot serve" in r.json()["error"]["message"]
    # the static part of the server info still answers
    assert "the engine cannot serve" in internal_state(s)["error"]


def test_steps_failing_again_and_again_take_the_engine_down(serve):
    from engine.server.runtime import MAX_FAILED_STEPS

    s = serve()

    def always_fail():
        raise RuntimeError("the device is gone")

    s.engine.step = always_fail
    for i in range(MAX_FAILED_STEPS):
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200, i
        r = httpx.post(s.url + "/v1/completions", json=completion(f"try {i}", 4), timeout=30)
        assert r.status_code == 500 and "the device is gone" in r.json()["error"]["message"]
    health = wait_health(s, 503)
    assert f"{MAX_FAILED_STEPS} engine steps in a row failed (the last: RuntimeError: the " \
           f"device is gone)" in health.json()["error"]["message"]
    r = httpx.post(s.url + "/v1/completions", json=completion("again", 4), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"


class LoopKiller(BaseException):
    """Not an Exception: nothing on the engine thread catches it, so the loop dies."""


def test_the_engine_loop_dying(serve):
    """A stream in flight gets an error, calls still queued for the engine thread get an answer
    (not a hang), /health says 503, and new requests get a 503."""
    s = serve()
    gate = threading.Event()

    def kill(engine):
        gate.wait(10)
        raise LoopKiller("the loop dies")

    async def on_server_loop():  # runtime.call() belongs to the server's event loop
        first = s.runtime.call(kill)
        second = s.runtime.call(lambda engine: "never run")
        tasks = [asyncio.ensure_future(first), asyncio.ensure_future(second)]
        await asyncio.sleep(0.2)  # both jobs queued before the first one kills the loop
        gate.set()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            first = asyncio.Event()
            streaming = asyncio.ensure_future(stream(http, s.url + "/v1/completions",
                                                     completion("one", stream=True), first))
            await first.wait()
            calls = await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(on_server_loop(), s.runtime.loop))
            return calls, await streaming

    (killed, never_run), lines = asyncio.run(asyncio.wait_for(main(), 60))
    from engine.server.runtime import EngineFailed

    for answer in (killed, never_run):
        assert isinstance(answer, EngineFailed), answer
        assert "the engine loop crashed: LoopKiller: the loop dies" in str(answer)
    assert "the engine loop crashed: LoopKiller" in stream_error(lines)["message"]
    health = httpx.get(s.url + "/health", timeout=10)
    assert health.status_code == 503 and "engine down: the engine loop crashed" in \
        health.json()["error"]["message"]
    r = httpx.post(s.url + "/v1/completions", json=completion("after", 4), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert "internal_states" in httpx.get(s.url + "/get_server_info", timeout=10).json()


def test_a_request_arriving_while_draining_gets_503(serve):
    """Its headers came in before SIGTERM, its body after: the route refuses it (503, Retry-After)
    and the server still stops cleanly."""
    s = serve()
    body = json.dumps(completion("late", 2)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    port = int(s.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head + body[:5])
        time.sleep(0.3)  # the route is reading the body
        s.server.handle_exit(signal.SIGTERM, None)  # what the SIGTERM handler runs
        assert s.runtime.draining
        time.sleep(0.3)  # uvicorn has closed its listener and begun its graceful shutdown
        sock.sendall(body[5:])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, rest = answer.split(b"\r\n", 1)
    headers, payload = rest.split(b"\r\n\r\n", 1)
    assert b" 503 " in status_line, answer
    assert b"retry-after: 1" in headers.lower()
    error = json.loads(payload)["error"]
    assert error["code"] == "server_overloaded" and "shutting down" in error["message"]
    s._thread.join(20)
    assert not s._thread.is_alive()


def test_requests_aborted_while_queued_leave_the_queue_and_flush_says_why_not(serve):
    """One running slot: a stream and a plain request queue behind a long stream and their
    clients leave; both leave the queue at once (never admitted) while the first still runs.
    Meanwhile /flush_cache refuses, saying what runs."""
    s = serve(max_running_requests=1)

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            first = asyncio.Event()
            running = asyncio.ensure_future(stream(
                http, s.url + "/v1/completions",
                completion("first", stream=True, stream_options={"include_usage": True}),
                first))
            await first.wait()
            async with http.stream("POST", s.url + "/v1/completions",
                                   json=completion("queued stream", stream=True)) as r:
                assert r.status_code == 200
                await wait_state(http, s, lambda st: st["num_queue_reqs"] == 1)
            after_stream = await wait_state(http, s, lambda st: st["num_queue_reqs"] == 0)
            with pytest.raises(httpx.ReadTimeout):
                await http.post(s.url + "/v1/completions", json=completion("queued plain"),
                                timeout=httpx.Timeout(30, read=0.5))
            after_plain = await wait_state(http, s, lambda st: st["num_queue_reqs"] == 0)
            busy = await http.post(s.url + "/flush_cache")
            return after_stream, after_plain, busy, await running

    after_stream, after_plain, busy, lines = asyncio.run(asyncio.wait_for(main(), 60))
    assert after_stream["num_running_reqs"] == after_plain["num_running_reqs"] == 1
    assert busy.status_code == 400, busy.text
    error = busy.json()["error"]
    assert error["code"] == "engine_busy"
    assert "Cache not flushed: 1 request(s) running and 0 queued" in error["message"]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][len("data: "):])["usage"]
    assert json.loads(lines[-3][len("data: "):])["choices"][0]["finish_reason"] == "length"
    m = metrics(s)
    assert m["engine:num_aborted_requests_total"] == 2
    # the queued prompts were never admitted: only the first one's prompt was
    assert m["engine:prompt_tokens_total"] == usage["prompt_tokens"]
    assert_all_free(internal_state(s), cached=None)


def metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if "le" not in sample.labels}


def test_flush_cache_says_when_the_engine_refused(serve):
    s = serve()
    r = httpx.post(s.url + "/v1/completions", json=completion("cache me please", 4), timeout=30)
    assert r.status_code == 200
    cached = internal_state(s)["kv_pool"]["cached_slots"]
    assert cached > 0

    def lock(engine, delta: int):  # as a running request would, with nothing running
        cache = engine.scheduler.kv.cache
        _, node = cache.match_prefix(engine.tokenize("cache me please"))
        (cache.inc_lock if delta > 0 else cache.dec_lock)(node)

    s.on_engine(lambda e: lock(e, 1))
    refused = httpx.post(s.url + "/flush_cache", timeout=10)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "engine_busy"
    assert "Cache not flushed: the engine refused" in error["message"]
    assert internal_state(s)["kv_pool"]["cached_slots"] == cached
    s.on_engine(lambda e: lock(e, -1))
    flushed = httpx.post(s.url + "/flush_cache", timeout=10)
    assert flushed.status_code == 200 and flushed.json() == {"message": "Cache flushed."}
    assert_all_free(internal_state(s), cached=0)
