"""`engine serve --tp-size 2`, and two "nodes" (two `engine serve` processes on 127.0.0.1 with
--nnodes 2): real servers, a real HTTP client, outputs equal to a one-process engine's; and the
ways it can go wrong, each ending in an error that names the rank or node, never a hang: a rank
killed while serving, a node that never comes, nodes started with different flags, a node
whose node 0 is not there. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from engine.net import free_port
from engine.server.process import ServerProcess

PROMPTS = ["Beautiful is better than ugly.", "Now is better than never.", "Errors should"]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
ENV = {"ENGINE_PARALLEL_CHECK": "1"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from engine_testing.checkpoints import make_tiny_model

    # 1 KV head over 2 ranks: replicated
    return make_tiny_model(str(tmp_path_factory.mktemp("tp") / "qwen2"), "Qwen2ForCausalLM",
                           num_key_value_heads=1)


@pytest.fixture(scope="module")
def reference(model):
    from engine.engine import Engine

    engine = Engine(model, device="cpu", dtype="float32", max_total_tokens=512)
    return [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]


def args(model: str, *more: str) -> list[str]:
    return ["--model", model, "--device", "cpu", "--dtype", "float32", "--max-total-tokens",
            "512", *more]


def generate(url: str) -> list[list[int]]:
    r = httpx.post(url + "/generate", json={"text": PROMPTS, "sampling_params": GREEDY},
                   timeout=120)
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


def node_process(model: str, log_path, *more: str) -> subprocess.Popen:
    """An `engine serve` of a node other than 0: no HTTP server, only its ranks."""
    engine = os.path.join(os.path.dirname(sys.executable), "engine")
    log = open(log_path, "w")
    return subprocess.Popen([engine, "serve", *args(model, *more)], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, **ENV})


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail(f"process {proc.args[:3]} still running after {timeout} s")


def test_tp2_serves_like_one_process_and_a_killed_rank_is_named(model, reference, tmp_path):
    server = ServerProcess(args(model, "--tp-size", "2", "--dist-timeout", "60"),
                           tmp_path / "tp2.log", env=ENV)
    try:
        server.wait_ready(180)
        assert generate(server.url) == reference
        info = httpx.get(server.url + "/get_server_info", timeout=10).json()
        ranks = info["parallel"]["ranks"]
        assert [(r["rank"], r["tp_rank"]) for r in ranks] == [(0, 0), (1, 1)]
        assert info["tp_size"] == 2 and info["parallel"]["backend"] == "gloo"
        # one KV head, replicated: each rank holds all of K/V but half the other weights
        assert ranks[0]["kv_bytes_per_token"] == ranks[1]["kv_bytes_per_token"]
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = httpx.get(server.url + "/health", timeout=5)
            if health.status_code == 503:
                break
            time.sleep(0.3)
        assert health.status_code == 503
        assert "rank 1 (tp 1) exited with code -9" in health.text
        r = httpx.post(server.url + "/generate", json={"text": "Now", "sampling_params": GREEDY},
                       timeout=30)
        assert r.status_code == 503 and "rank 1 (tp 1)" in r.text
    finally:
        server.stop()
    assert "the engine cannot serve: rank 1 (tp 1) exited with code -9" in server.log()


def test_pp2_serves_like_one_process(model, reference, tmp_path):
    """Two stages (one layer each) behind `engine serve`, the batch in two micro-batches."""
    server = ServerProcess(args(model, "--pp-size", "2", "--dist-timeout", "60"),
                           tmp_path / "pp2.log", env=ENV)
    try:
        server.wait_ready(180)
        assert generate(server.url) == reference
        ranks = httpx.get(server.url + "/get_server_info", timeout=10).json()["parallel"]["ranks"]
        assert [r["pp_rank"] for r in ranks] == [0, 1]
    finally:
        assert server.stop() == 0
    assert "cuda graph: off (CUDA graphs need a CUDA GPU" in server.log()


def test_two_nodes_serve_together(model, reference, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    common = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--dist-timeout", "60")
    node1 = node_process(model, tmp_path / "node1.log", *common, "--node-rank", "1")
    node0 = ServerProcess(args(model, *common, "--node-rank", "0"), tmp_path / "node0.log",
                          env=ENV)
    try:
        node0.wait_ready(180)
        assert generate(node0.url) == reference
        assert httpx.get(node0.url + "/get_server_info", timeout=10).json()[
            "parallel"]["ranks"][1]["node"] == 1
    finally:
        assert node0.stop() == 0
        code = wait_exit(node1, 60)  # stopped by rank 0, not left behind
    log1 = (tmp_path / "node1.log").read_text()
    assert code == 0, log1
    assert "rank 1 (tp 1, node 1): stopped by rank 0" in log1


def test_a_node_that_never_comes_is_named(model, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    node0 = ServerProcess(args(model, "--tp-size", "2", "--nnodes", "2", "--node-rank", "0",
                               "--dist-init-addr", addr, "--dist-timeout", "3"),
                          tmp_path / "node0.log")
    assert wait_exit(node0.proc, 90) != 0
    assert (f"node 1 (ranks 1..1) did not join within 3 s at {addr}: start `engine serve` "
            f"there with the same model and flags plus --nnodes 2 --node-rank 1") in node0.log()


def test_a_node_without_node_0_says_so(model, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    node1 = node_process(model, tmp_path / "node1.log", "--tp-size", "2", "--nnodes", "2",
                         "--node-rank", "1", "--dist-init-addr", addr, "--dist-timeout", "3")
    assert wait_exit(node1, 90) != 0
    assert f"cannot reach node 0 at {addr} within 3 s" in (tmp_path / "node1.log").read_text()


def test_nodes_started_with_different_flags_are_refused(model, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    common = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--dist-timeout", "60")
    node1 = node_process(model, tmp_path / "node1.log", *common, "--node-rank", "1",
                         "--max-model-len", "256")
    node0 = ServerProcess(args(model, *common, "--node-rank", "0"), tmp_path / "node0.log")
    assert wait_exit(node0.proc, 90) != 0
    assert wait_exit(node1, 90) != 0
    message = ("node 1 (ranks 1..1) was started with --max-model-len 256 (node 0: None): start "
               "every node with the same model and flags")
    assert message in node0.log()
    assert message in (tmp_path / "node1.log").read_text()
