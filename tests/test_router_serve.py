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

from engine.server.process import ServerProcess

TIMEOUT = httpx.Timeout(120.0, connect=10.0)
KEY = "sekret-key-issue-28"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def dp_server(tiny_model_factory, tmp_path):
    # the key in the front's environment (ENGINE_API_KEY), as the replicas get it
    server = ServerProcess(["--model", tiny_model_factory("llama"), "--dp-size", "2",
                            "--router-policy", "round_robin", "--max-total-tokens", "2048",
                            "--shutdown-grace-period", "2"],
                           tmp_path / "front.log",
                           env={"OMP_NUM_THREADS": "1", "ENGINE_API_KEY": KEY})
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
    return httpx.get(server.url + "/get_server_info", headers=AUTH, timeout=TIMEOUT).json()


def _metric(server, line_prefix: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=TIMEOUT).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(line_prefix + " ")]
    assert len(values) == 1, (line_prefix, text[-2000:])
    return values[0]


def _call(url: str, route: str, body: dict) -> dict:
    """One request; its answer (all SSE events when streaming)."""
    if not body.get("stream"):
        r = httpx.post(url + route, json=body, headers=AUTH, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()
    events = []
    with httpx.stream("POST", url + route, json=body, headers=AUTH, timeout=TIMEOUT) as r:
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
    model = httpx.get(dp_server.url + "/v1/models", headers=AUTH,
                      timeout=TIMEOUT).json()["data"][0]["id"]
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
    flushed = httpx.post(dp_server.url + "/flush_cache", headers=AUTH, timeout=TIMEOUT).json()
    assert [r["dp_rank"] for r in flushed["replicas"]] == [0, 1]


def test_killed_replica_is_reported_restarted_and_back_in_rotation(dp_server):
    url = dp_server.url
    body = {"text": "a long answer", "stream": True,
            "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    with httpx.stream("POST", url + "/generate", json=body, headers=AUTH,
                      timeout=TIMEOUT) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is generating
        busy = next(r for r in _info(dp_server)["replicas"] if r["load"] == 1)
        os.kill(busy["pid"], signal.SIGKILL)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    # the in-flight stream ends with an error event, not a hang
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    rank = busy["dp_rank"]
    assert error["code"] == "replica_failed" and f"dp rank {rank}" in error["message"]
    # every request is answered meanwhile (by the survivor while rank is down)
    for i in range(4):
        answer = _call(url, "/generate", {"text": f"after {i}",
                                          "sampling_params": {"max_new_tokens": 2}})
        assert answer["meta_info"]["completion_tokens"] == 2
    assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
    assert re.search(rf"dp rank {rank} \(.*\) is down: process {busy['pid']} killed "
                     rf"by SIGKILL; it is out of rotation", dp_server.log())
    # issue 28: it is restarted (after a backoff, logged) and back in rotation once healthy
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        info = _info(dp_server)
        if info["live_replicas"] == 2:
            break
        time.sleep(0.5)
    back = info["replicas"][rank]
    assert back["alive"] and back["restarts"] == 1 and back["pid"] != busy["pid"], info
    assert _running(back["pid"])
    log = dp_server.log()
    assert f"dp rank {rank}: restarting it in 1 s (restart 1 of at most 5 in a row)" in log
    assert re.search(rf"dp rank {rank} \(.*, pid {back['pid']}\) is healthy again: back in "
                     rf"rotation", log)
    before = back["routed_requests"]
    for i in range(4):  # round_robin: two of them reach the restarted replica, which serves
        answer = _call(url, "/generate", {"text": f"back {i}",
                                          "sampling_params": {"max_new_tokens": 2}})
        assert answer["meta_info"]["completion_tokens"] == 2
    assert _info(dp_server)["replicas"][rank]["routed_requests"] == before + 2
    assert _metric(dp_server, f'engine:dp_replica_up{{dp_rank="{rank}"}}') == 1


def test_the_api_key_reaches_the_replicas_off_their_command_line(dp_server):
    """Issue 28: a replica's --api-key was readable by anyone in /proc/<pid>/cmdline."""
    replicas = _info(dp_server)["replicas"]
    for r in replicas:
        with open(f"/proc/{r['pid']}/cmdline", "rb") as f:
            cmdline = f.read().decode()
        assert KEY not in cmdline and "--api-key" not in cmdline, cmdline
        # the replica itself still wants the key
        assert httpx.get(r["url"] + "/v1/models", timeout=TIMEOUT).status_code == 401
        assert httpx.get(r["url"] + "/v1/models", headers=AUTH,
                         timeout=TIMEOUT).status_code == 200
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(dp_server.url + "/generate", json=body,
                      timeout=TIMEOUT).status_code == 401
    assert httpx.post(dp_server.url + "/generate", json=body, headers=AUTH,
                      timeout=TIMEOUT).status_code == 200


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
