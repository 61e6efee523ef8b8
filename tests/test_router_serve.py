"""`engine serve --dp-size 2` end to end: two replica processes behind the front on 127.0.0.1,
concurrent clients, and a replica killed under traffic."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.testing import ServerProcess

TIMEOUT = httpx.Timeout(120.0, connect=10.0)


@pytest.fixture
def dp_server(tiny_model_factory, tmp_path):
    server = ServerProcess(["--model", tiny_model_factory("llama"), "--dp-size", "2",
                            "--router-policy", "round_robin", "--max-total-tokens", "2048",
                            "--shutdown-grace-period", "2"],
                           tmp_path / "front.log", env={"OMP_NUM_THREADS": "1"})
    try:
        server.wait_ready(timeout=180)
        yield server
    finally:
        pids = [r["pid"] for r in _info(server)["replicas"]] if server.proc.poll() is None else []
        assert server.stop() == 0, server.log()[-3000:]
        for pid in pids:  # the front stops its replicas
            assert not _running(pid), f"replica pid {pid} outlived the front"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read()


def _info(server) -> dict:
    return httpx.get(server.url + "/get_server_info", timeout=TIMEOUT).json()


def _metric(server, line_prefix: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(line_prefix + " ")]
    assert len(values) == 1, (line_prefix, text[-2000:])
    return values[0]


def _call(url: str, route: str, body: dict) -> dict:
    """One request; its answer (all SSE events when streaming)."""
    if not body.get("stream"):
        r = httpx.post(url + route, json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()
    events = []
    with httpx.stream("POST", url + route, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", events
    return {"events": [json.loads(e) for e in events[:-1]]}


def test_dp2_serves_concurrent_clients_each_request_once(dp_server):
    info = _info(dp_server)
    assert info["dp_size"] == 2 and info["live_replicas"] == 2
    assert len(info["internal_states"]) == 2
    model = httpx.get(dp_server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
    jobs = []
    for i in range(12):
        prompt = f"client {i} says hello"
        kind = i % 3
        if kind == 0:
            jobs.append(("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4}))
        elif kind == 1:
            jobs.append(("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4,
                                             "stream": True}))
        else:
            jobs.append(("/generate", {"text": prompt, "stream": i % 2 == 0,
                                       "sampling_params": {"max_new_tokens": 4}}))
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda job: _call(dp_server.url, *job), jobs))
    for (route, body), answer in zip(jobs, answers):
        if route == "/v1/completions" and not body.get("stream"):
            assert answer["usage"]["completion_tokens"] == 4
        elif route == "/v1/completions":
            assert answer["events"][-1]["choices"][0]["finish_reason"] == "length"
        elif body["stream"]:
            assert answer["events"][-1]["meta_info"]["completion_tokens"] == 4
        else:
            assert answer["meta_info"]["completion_tokens"] == 4
    # each request reached exactly one replica, and round_robin split them evenly
    routed = {r["dp_rank"]: r["routed_requests"] for r in _info(dp_server)["replicas"]}
    assert routed == {0: 6, 1: 6}  # /v1/models is forwarded, not routed
    # the replicas finished each request once: 12 in total over the two
    assert _metric(dp_server, 'engine:num_requests_total{model_name="%s"}' % model) == 12
    assert _metric(dp_server, "engine:dp_routed_requests_total") == 12
    flushed = httpx.post(dp_server.url + "/flush_cache", timeout=TIMEOUT).json()
    assert [r["dp_rank"] for r in flushed["replicas"]] == [0, 1]


def test_killed_replica_is_reported_and_its_traffic_moves(dp_server):
    url = dp_server.url
    body = {"text": "a long answer", "stream": True,
            "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    with httpx.stream("POST", url + "/generate", json=body, timeout=TIMEOUT) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is generating
        busy = next(r for r in _info(dp_server)["replicas"] if r["load"] == 1)
        os.kill(busy["pid"], signal.SIGKILL)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    # the in-flight stream ends with an error event, not a hang
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "replica_failed" and f"dp rank {busy['dp_rank']}" in error["message"]
    deadline = time.monotonic() + 10
    while _info(dp_server)["live_replicas"] != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    info = _info(dp_server)
    dead = info["replicas"][busy["dp_rank"]]
    assert not dead["alive"] and "killed by SIGKILL" in dead["error"]
    assert re.search(rf"dp rank {busy['dp_rank']} \(.*\) is down: process {busy['pid']} killed "
                     rf"by SIGKILL; it is out of rotation", dp_server.log())
    # every later request goes to the live replica, and is answered
    survivor = 1 - busy["dp_rank"]
    before = info["replicas"][survivor]["routed_requests"]
    for i in range(4):
        answer = _call(url, "/generate", {"text": f"after {i}",
                                          "sampling_params": {"max_new_tokens": 2}})
        assert answer["meta_info"]["completion_tokens"] == 2
    assert _info(dp_server)["replicas"][survivor]["routed_requests"] == before + 4
    assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
    assert _metric(dp_server, f'engine:dp_replica_up{{dp_rank="{busy["dp_rank"]}"}}') == 0


def test_a_replica_that_cannot_start_stops_the_front_with_its_reason(tiny_model_factory,
                                                                      tmp_path):
    server = ServerProcess(["--model", tiny_model_factory("llama"), "--dp-size", "2",
                            "--attention-backend", "flashinfer"],  # registered, unusable on CPU
                           tmp_path / "front.log", env={"OMP_NUM_THREADS": "1"})
    with pytest.raises(RuntimeError, match="server exited with 1"):
        server.wait_ready(timeout=120)
    log = server.log()
    assert re.search(r"Error: dp rank \d exited with code 2 while starting", log), log[-3000:]
    assert "flashinfer" in log
    server.stop()
