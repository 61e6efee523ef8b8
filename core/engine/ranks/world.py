"""A rank's place in the world of ``--tp-size`` x ``--pp-size`` ranks: its topology, its share
of a CPU's cores, joining the process group (bounded, naming a local rank that died meanwhile)
with the control group, its tp group and its pipeline stage; and the local rank processes
watched and stopped. Shared by rank 0 (launch.py, executor.py) and the workers (worker.py)."""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import EngineError
from engine.parallel.group import TPGroup
from engine.parallel.stage import make_stage
from engine.parallel.topology import Topology
from engine.ranks import rendezvous

# the control group (rank 0's messages) waits as long as the server idles
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass
class RankContext:
    """One rank's place in the world, once it joined."""
    topo: Topology
    rank: int
    store: object
    control: object  # a gloo group over every rank: rank 0's messages
    tp: object | None  # this rank's TPGroup (None: tp 1)
    stage: object | None  # this rank's PPStage (None: pp 1)


def topology(config) -> Topology:
    return Topology(config.tp_size, config.pp_size, config.nnodes, config.node_rank)


def set_threads(topo: Topology, device) -> None:
    """On a CPU the node's ranks share its cores: give each its share (at least one). The cores
    are those OMP_NUM_THREADS gives this engine (a --dp-size replica gets 1/N of them), else all
    of the machine's."""
    if not device.is_cuda:
        given = os.environ.get("OMP_NUM_THREADS", "")
        cores = int(given) if given.isdigit() and int(given) > 0 else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // topo.per_node))


def join_world(config, topo: Topology, rank: int, store, strategy, num_layers: int,
               describe_local=None) -> RankContext:
    """Join the process group (bounded by --dist-timeout), then make the control group, the
    stages' tp groups and this rank's stage. ``describe_local()``: what is known about local
    ranks that exited, for the error when joining fails."""
    error = _join(strategy, rank, topo.world, dist.PrefixStore("pg", store), config.dist_timeout,
                  describe_local)
    if error is not None:
        known = describe_local() if describe_local else None
        raise EngineError(
            f"{topo.describe(rank)} could not join the {topo.world} ranks' "
            f"{strategy.backend} group within --dist-timeout {config.dist_timeout} s"
            f"{': ' + known if known else ''} ({error}).")
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    # every rank creates every stage's group, in the same order (torch.distributed's rule)
    groups = [dist.new_group(topo.stage_ranks(s)) if topo.pp > 1 and topo.tp > 1 else None
              for s in range(topo.pp)]
    tp = None
    if topo.tp > 1:
        tp = TPGroup(topo.tp_rank(rank), topo.tp, group=groups[topo.pp_rank(rank)],
                     ep_size=config.ep_size)
    stage = None
    if topo.pp > 1:
        stage = make_stage(num_layers, topo.pp_rank(rank), topo.pp)
    return RankContext(topo, rank, store, control, tp, stage)


# a join given up on (a local rank exited): its thread waits on until --dist-timeout
_abandoned: threading.Thread | None = None


def _forget_abandoned_join() -> None:
    """Before joining again in this process: let a join given up on end (its wait is bounded
    by --dist-timeout), then start torch.distributed's group numbering over, as a fresh
    worker's is (the ended join counted a group: the next one's name would not match the
    workers', and joining would wait for keys they never write)."""
    global _abandoned
    if _abandoned is not None:
        _abandoned.join()
        _abandoned = None
    if not dist.is_initialized():
        from torch.distributed import distributed_c10d

        world = getattr(distributed_c10d, "_world", None)
        if world is not None and hasattr(world, "group_count"):
            world.group_count = 0


def _join(strategy, rank: int, world: int, store, timeout_s: int, describe_local) -> str | None:
    """``strategy.init_rank`` on a thread, so that a local rank that exits meanwhile ends the
    wait at once (named) instead of after the whole timeout; None once joined."""
    global _abandoned
    _forget_abandoned_join()
    failed: list[str] = []

    def join():
        try:
            strategy.init_rank(rank, world, store, timeout_s)
        except Exception as e:  # noqa: BLE001 - a timeout or a connection error
            failed.append(f"{type(e).__name__}: {str(e)[:300]}")

    thread = threading.Thread(target=join, name="join-world", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
        if thread.is_alive() and describe_local and describe_local():
            _abandoned = thread
            return "gave up waiting for it"
    return failed[0] if failed else None


def exited(topo: Topology, procs: dict, store) -> str | None:
    """The first local rank that exited, with its last words (when ``store`` is given: not
    while another thread waits on it, which holds the store's client), or None."""
    for rank, proc in procs.items():
        code = proc.poll()
        if code is not None:
            error = rendezvous.read_error(store, rank) if store is not None else None
            return (f"{topo.describe(rank)} exited with code {code}"
                    f"{': ' + error if error else ''}")
    return None


def stop_processes(procs: dict, timeout: float = 10.0) -> None:
    for proc in procs.values():
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
