"""Where the ranks meet, and how they find out about each other's trouble, all through one
torch.distributed TCPStore that node 0 (rank 0's process) hosts at ``--dist-init-addr``:

- ``node/<n>``: node n's fingerprint (model and the flags every rank must agree on); node 0
  compares them and answers in ``verdict``, so a node started with other flags fails with the
  difference named, before any rank loads a weight;
- the process group is then initialised on the same store (``pg/`` keys);
- ``beat/<rank>``: a counter each worker bumps every second (rank 0 watches it: a rank that
  stops is named); ``error/<rank>``: why a worker is exiting, for rank 0 to report.

Every wait is bounded by ``--dist-timeout``: a node that never comes is an error naming it."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from engine.errors import EngineError
from engine.parallel.topology import Topology

logger = logging.getLogger("engine.parallel")
BEAT_S = 1.0  # a worker's heartbeat period
# flags every node must be started with alike (the rest only matter on node 0)
NODE_FLAGS = ("tp_size", "pp_size", "ep_size", "nnodes", "dtype", "device", "kv_cache_dtype",
              "quantization", "attention_backend", "page_size", "max_model_len")


def store_address(config) -> tuple[str, int]:
    """(host, port) of the store: --dist-init-addr, or a free local port for one node."""
    if config.dist_init_addr:
        host, _, port = config.dist_init_addr.rpartition(":")
        return host, int(port)
    from engine.net import free_port

    return "127.0.0.1", free_port()


def open_store(host: str, port: int, is_master: bool, timeout_s: int):
    """Host the store (node 0) or connect to it, retrying until ``timeout_s``."""
    try:
        return dist.TCPStore(host, port, world_size=None, is_master=is_master,
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError or DistNetworkError
        if is_master:
            raise EngineError(f"cannot listen on {host}:{port} for the other ranks ({e}); give "
                              f"--dist-init-addr a free port of this host.") from None
        raise EngineError(f"cannot reach node 0 at {host}:{port} within {timeout_s} s ({e}); "
                          f"start node 0 first (or check --dist-init-addr and that its port "
                          f"is open).") from None


def fingerprint(config, model_config) -> dict:
    """What a node must agree on with node 0."""
    flags = {k: getattr(config, k) for k in NODE_FLAGS}
    mc = model_config
    flags["model"] = {"architecture": mc.architecture, "num_layers": mc.num_layers,
                      "hidden_size": mc.hidden_size, "num_heads": mc.num_heads,
                      "num_kv_heads": mc.num_kv_heads, "vocab_size": mc.vocab_size}
    return flags


def _differences(ours: dict, theirs: dict) -> list[str]:
    out = []
    for key in ours:
        if ours[key] != theirs.get(key):
            if key == "model":
                out.append(f"a different model ({theirs.get(key)} vs node 0's {ours[key]})")
            else:
                flag = "--" + key.replace("_", "-")
                out.append(f"{flag} {theirs.get(key)} (node 0: {ours[key]})")
    return out


def agree_nodes(store, topo: Topology, mine: dict, timeout_s: int, addr: str) -> None:
    """Node 0: wait for every other node's fingerprint and compare; other nodes: publish theirs
    and wait for node 0's verdict. Raises a clear EngineError on any node when they differ or
    a node does not come within ``timeout_s``."""
    timeout = timedelta(seconds=timeout_s)
    if topo.node_rank != 0:
        store.set(f"node/{topo.node_rank}", json.dumps(mine))
        try:
            store.wait(["verdict"], timeout)
        except Exception:  # noqa: BLE001
            raise EngineError(f"node 0 at {addr} did not accept node {topo.node_rank} within "
                              f"{timeout_s} s.") from None
        verdict = store.get("verdict").decode()
        if verdict != "ok":
            raise EngineError(verdict)
        return
    for node in range(1, topo.nnodes):
        ranks = range(node * topo.per_node, (node + 1) * topo.per_node)
        try:
            store.wait([f"node/{node}"], timeout)
        except Exception:  # noqa: BLE001 - a timeout
            message = (f"node {node} (ranks {ranks[0]}..{ranks[-1]}) did not join within "
                       f"{timeout_s} s at {addr}: start `engine serve` there with the same "
                       f"model and flags plus --nnodes {topo.nnodes} --node-rank {node} "
                       f"--dist-init-addr {addr}.")
            store.set("verdict", message)
            raise EngineError(message) from None
        theirs = json.loads(store.get(f"node/{node}"))
        diff = _differences(mine, theirs)
        if diff:
            message = (f"node {node} (ranks {ranks[0]}..{ranks[-1]}) was started with "
                       f"{'; '.join(diff)}: start every node with the same model and flags.")
            store.set("verdict", message)
            raise EngineError(message)
    store.set("verdict", "ok")


def init_process_group(store, backend: str, rank: int, world: int, timeout_s: int,
                       topo: Topology) -> None:
    """Join the default process group (the device backend) on ``store``."""
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001
        raise EngineError(f"{topo.describe(rank)} could not join the {world} ranks' "
                          f"{backend} group within {timeout_s} s ({type(e).__name__}: {e}).") \
            from None


def report_forward(store, rank: int, seq: int, error: str | None) -> None:
    """A worker finished its ``seq``-th forward (``error``: it raised, and goes on): rank 0
    reads it only when its own part of that forward failed."""
    store.set(f"forward/{rank}", f"{seq} {error or 'ok'}")


def read_forward(store, rank: int) -> tuple[int, str] | None:
    """(seq, "ok" or the error) of the last forward ``rank`` finished; None before any."""
    try:
        if store.check([f"forward/{rank}"]):
            seq, _, status = store.get(f"forward/{rank}").decode().partition(" ")
            return int(seq), status
    except Exception:  # noqa: BLE001 - the store may be gone: the caller blames someone
        pass
    return None


def report_error(store, rank: int, message: str) -> None:
    """A worker's last words, for rank 0 to name it with."""
    try:
        store.set(f"error/{rank}", message)
    except Exception:  # noqa: BLE001 - the store (rank 0) may be gone too
        pass


def read_error(store, rank: int) -> str | None:
    try:
        if store.check([f"error/{rank}"]):
            return store.get(f"error/{rank}").decode()
    except Exception:  # noqa: BLE001
        pass
    return None


def start_heartbeat(store, rank: int) -> threading.Thread:
    """Bump ``beat/<rank>`` every second; when the store is gone (rank 0 died) or this
    process's parent died, say so and exit: a worker never outlives its engine."""
    parent = os.getppid()

    def beat():
        while True:
            try:
                store.add(f"beat/{rank}", 1)
            except Exception:  # noqa: BLE001
                logger.error(f"rank {rank}: lost node 0's store (rank 0 is gone); exiting")
                os._exit(1)
            if os.getppid() != parent:
                logger.error(f"rank {rank}: its parent process exited; exiting")
                os._exit(1)
            time.sleep(BEAT_S)

    thread = threading.Thread(target=beat, name=f"heartbeat-{rank}", daemon=True)
    thread.start()
    return thread


def read_beat(store, rank: int) -> int:
    return int(store.add(f"beat/{rank}", 0))
