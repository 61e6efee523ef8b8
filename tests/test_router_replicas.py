"""The dp replicas' share of the machine (fake device counts: no GPU needed), the environment
and command line they are started with, and their restarts (fake replica processes)."""

from __future__ import annotations

import json
import logging
import sys
import time

import pytest

from engine.router.launch import replica_placements
from engine.router.replicas import ReplicaSet, place


def test_gpu_replicas_each_get_their_own_devices():
    gpus = [str(i) for i in range(8)]
    placements, _ = replica_placements(4, ["--model", "m"], {"tp_size": 2}, gpus=gpus, cpus=64,
                                       env={})
    assert [p.env for p in placements] == [{"CUDA_VISIBLE_DEVICES": "0,1"},
                                           {"CUDA_VISIBLE_DEVICES": "2,3"},
                                           {"CUDA_VISIBLE_DEVICES": "4,5"},
                                           {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert all(p.args == [] for p in placements)  # the memory fraction is of its own GPU
    assert "GPU(s) 2,3" in placements[1].note
    # tp x pp devices per replica, out of the devices this process was given
    placements, _ = replica_placements(2, [], {"tp_size": 1, "pp_size": 2},
                                       gpus=["4", "5", "6", "7"], cpus=8, env={})
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placements] == ["4,5", "6,7"]


def test_too_few_gpus_for_a_device_of_their_own_is_refused():
    with pytest.raises(ValueError, match=r"needs 4 GPUs, 3 visible"):
        place(2, 2, ["0", "1", "2"], 8, None, {})


def test_cpu_replicas_split_the_threads_and_the_memory_fraction():
    args = ["--model", "m", "--mem-fraction-static", "0.6", "--max-total-tokens", "512"]
    placements, common = replica_placements(4, args, {"device": "cpu",
                                                      "mem_fraction_static": 0.6},
                                            gpus=["0", "1"], cpus=16, env={})
    assert [p.env for p in placements] == [{"OMP_NUM_THREADS": "4"}] * 4
    assert [p.args for p in placements] == [["--mem-fraction-static", "0.15"]] * 4
    assert common == ["--model", "m", "--max-total-tokens", "512"]  # the 0.6 is not passed on
    assert "4 thread(s) (of 16 cores / 4 replicas)" in placements[0].note
    assert "--mem-fraction-static 0.15 (the memory fraction 0.6 / 4 replicas)" in \
        placements[0].note
    # no GPU, the default fraction; more replicas than cores: one thread each
    placements, _ = replica_placements(3, [], {}, gpus=[], cpus=2, env={})
    assert placements[0].env == {"OMP_NUM_THREADS": "1"}
    assert placements[0].args == ["--mem-fraction-static", "0.1"]  # 0.3 (CPU default) / 3
    # OMP_NUM_THREADS set for the front: each replica keeps it
    placements, _ = replica_placements(2, [], {}, gpus=[], cpus=16, env={"OMP_NUM_THREADS": "3"})
    assert placements[1].env == {"OMP_NUM_THREADS": "3"}


DUMP = ("import json, os, sys; json.dump({'argv': sys.argv[2:], 'env': "
        "{k: os.environ.get(k) for k in ('ENGINE_API_KEY', 'OMP_NUM_THREADS', "
        "'CUDA_VISIBLE_DEVICES')}}, open(sys.argv[1], 'w'))")


def test_each_replica_starts_with_its_share_and_the_key_in_its_environment(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("ENGINE_API_KEY", "the-front-s-own")  # replaced by the one given
    placements, common = replica_placements(2, ["--model", "m"], {"tp_size": 1},
                                            gpus=["0", "1", "2"], cpus=8, env={})

    def cmd(args, port):
        return [sys.executable, "-c", DUMP, str(tmp_path / f"{port}.json"), *args]

    replicas = ReplicaSet(2, common, api_key="k3y", placements=placements, cmd=cmd)
    replicas.start()
    seen = []
    for r in replicas.replicas:
        assert r.proc.wait(30) == 0
        seen.append(json.loads((tmp_path / f"{r.port}.json").read_text()))
    assert seen == [{"argv": ["--model", "m"], "env": {"ENGINE_API_KEY": "k3y",
                                                       "OMP_NUM_THREADS": None,
                                                       "CUDA_VISIBLE_DEVICES": str(i)}}
                    for i in range(2)]


def test_a_dead_replica_is_restarted_with_backoff_a_bounded_number_of_times(tmp_path, caplog):
    starts = tmp_path / "starts"

    def cmd(args, port):  # a replica that dies at once, every time
        return [sys.executable, "-c", f"open({str(starts)!r}, 'a').write('x'); "
                                      f"raise SystemExit(3)"]

    replicas = ReplicaSet(1, [], max_restarts=3, backoff_s=0.05, cmd=cmd)
    [r] = replicas.replicas
    with caplog.at_level(logging.INFO, logger="engine.router"):
        replicas.start()
        deadline = time.monotonic() + 60
        delays = []
        while not r.gave_up:
            assert time.monotonic() < deadline, "never gave up"
            replicas.check_exits()
            if r.restart_at is not None and len(delays) < r.failures:
                delays.append(round(r.restart_at - time.monotonic(), 2))
            replicas.restart_due()
            time.sleep(0.01)
    assert starts.read_text() == "x" * 4  # the first start and 3 restarts
    assert r.restarts == 3 and not r.alive and r.gave_up
    assert "exited with code 3" in r.error and "at most 3 restarts" in r.error
    assert delays[0] <= 0.05 and 0.05 < delays[1] <= 0.1 and 0.1 < delays[2] <= 0.2  # doubling
    messages = [rec.getMessage() for rec in caplog.records]
    assert "dp rank 0: restarting it in 0.05 s (restart 1 of at most 3 in a row)" in messages
    assert "dp rank 0: giving up after 3 restart(s) in a row; it stays out of rotation" in messages
    # a stopping set restarts nothing
    replicas2 = ReplicaSet(1, [], backoff_s=0.0, cmd=cmd)
    replicas2.start()
    replicas2.stop(0)
    replicas2.replicas[0].proc.wait(10)
    replicas2.check_exits()
    assert replicas2.replicas[0].restart_at is None


def test_a_replicas_tp_ranks_share_the_cores_it_was_given(monkeypatch):
    """A --dp-size replica gets OMP_NUM_THREADS = cores / N; its tp ranks split those, not the
    machine's."""
    import torch

    from engine.device import DeviceInfo
    from engine.ranks.world import set_threads
    from engine.parallel.topology import Topology

    cpu = DeviceInfo("cpu", "CPU")
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "8")
        set_threads(Topology(2, 1, 1, 0), cpu)
        assert torch.get_num_threads() == 4
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr("os.cpu_count", lambda: 6)
        set_threads(Topology(3, 1, 1, 0), cpu)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
