"""Starting the ranks of ``--tp-size`` x ``--pp-size`` (over ``--nnodes``): node 0's engine
process is rank 0; it hosts the store (rendezvous.py), checks the other nodes, starts its
node's other ranks as ``python -m engine.parallel.worker`` processes, joins the process group
with them and builds its shard. Another node (``engine serve --node-rank N``) starts its ranks
the same way and serves as a worker itself: no scheduler, no HTTP."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel import rendezvous
from engine.parallel.topology import Topology
from engine.registry import EngineError

logger = logging.getLogger("engine.parallel")
# how a worker rank is started: `python <this> RANK SPEC` (tests put a failing script here)
WORKER_COMMAND = ["-m", "engine.parallel.worker"]
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
    from engine.parallel.group import TPGroup

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
        tp = TPGroup(topo.tp_rank(rank), topo.tp, group=groups[topo.pp_rank(rank)])
    stage = None
    if topo.pp > 1:
        from engine.parallel.stage import make_stage

        stage = make_stage(num_layers, topo.pp_rank(rank), topo.pp)
    return RankContext(topo, rank, store, control, tp, stage)


def _join(strategy, rank: int, world: int, store, timeout_s: int, describe_local) -> str | None:
    """``strategy.init_rank`` on a thread, so that a local rank that exits meanwhile ends the
    wait at once (named) instead of after the whole timeout; None once joined."""
    import threading

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
            return "gave up waiting for it"
    return failed[0] if failed else None


def spawn_local_ranks(config, ranks, host: str, port: int, resolved: dict,
                      log_level: str) -> dict[int, subprocess.Popen]:
    """Start ``ranks`` of this node as worker processes; they inherit stdout and stderr."""
    spec = {"config": asdict(config), "host": host, "port": port, "resolved": resolved,
            "log_level": log_level}
    procs = {}
    for rank in ranks:
        procs[rank] = subprocess.Popen(
            [sys.executable, *WORKER_COMMAND, str(rank), json.dumps(spec)])
    return procs


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


def start_rank0(config, checkpoint, model_config, regs, device, strategy, entries: dict,
                agreed: dict):
    """Node 0: host the store, check the other nodes, start this node's other ranks, join
    them, and build rank 0's shard. ``entries``: the resolved attention, kv and quant entries;
    ``agreed``: node 0's fingerprint (rendezvous.fingerprint, of the flags as given).
    Returns the ParallelRunner the engine uses as its runner."""
    from engine.parallel.executor import ParallelRunner
    from engine.runner import build_runner

    topo = topology(config)
    set_threads(topo, device)
    host, port = rendezvous.store_address(config)
    addr = f"{host}:{port}"
    store = rendezvous.open_store(host, port, True, config.dist_timeout)
    # what node 0 resolved ("auto" backends, page size): every rank builds the same
    resolved = {"attention": entries["attention"].name, "page_size": config.page_size,
                "quantization": entries["quant"].name if entries["quant"] else None}
    store.set("resolved", json.dumps(resolved))
    rendezvous.agree_nodes(store, topo, agreed, config.dist_timeout, addr)
    level = logging.getLevelName(logging.getLogger("engine").getEffectiveLevel())
    procs = spawn_local_ranks(config, [r for r in topo.local_ranks if r != 0], host, port,
                              resolved, level)
    logger.info(f"parallel: {topo.world} ranks (tp {topo.tp} x pp {topo.pp}) over "
                f"{topo.nnodes} node(s), meeting at {addr}; started local ranks "
                f"{sorted(procs)}")
    try:
        ctx = join_world(config, topo, 0, store, strategy, model_config.num_layers,
                         lambda: exited(topo, procs, None))
        runner = build_runner(config, checkpoint, regs, device, entries["attention"],
                              entries["kv"], entries["quant"], ctx.tp, ctx.stage)
        return ParallelRunner(runner, ctx, procs, config)
    except BaseException:
        for proc in procs.values():
            proc.kill()
        stop_processes(procs)
        raise


def serve_node(config, log_level: str = "info") -> None:
    """Node ``--node-rank`` > 0: publish this node's fingerprint, start its ranks (the first
    one in this process) and serve as workers until rank 0 stops them."""
    from engine.models import default
    from engine.models.checkpoint import open_checkpoint
    from engine.models.config import ModelConfig
    from engine.parallel import worker
    from engine.plugins import get_registries

    topo = topology(config)
    host, port = rendezvous.store_address(config)
    addr = f"{host}:{port}"
    regs = get_registries()
    ckpt = open_checkpoint(config.model or default.default_model_path())
    mc = ModelConfig.from_checkpoint(ckpt, regs.models)
    store = rendezvous.open_store(host, port, False, config.dist_timeout)
    rendezvous.agree_nodes(store, topo, rendezvous.fingerprint(config, mc), config.dist_timeout,
                           addr)
    resolved = json.loads(store.get("resolved"))
    config.attention_backend, config.page_size = resolved["attention"], resolved["page_size"]
    first, *others = topo.local_ranks
    procs = spawn_local_ranks(config, others, host, port, resolved, log_level)
    logger.info(f"node {topo.node_rank}: ranks {list(topo.local_ranks)} of {topo.world} "
                f"joining node 0 at {addr}")
    try:
        worker.run(config, first, host, port, resolved)
    finally:
        stop_processes(procs)


def check_model_splits(config, model_config) -> None:
    """Refuse, before any process starts, a model that does not split over the ranks."""
    from engine.parallel.shard import rank_head_counts, split_evenly
    from engine.parallel.stage import split_layers

    mc = model_config
    if config.tp_size > 1:
        rank_head_counts(mc.num_heads, mc.num_kv_heads, config.tp_size)
        split_evenly(mc.intermediate_size, config.tp_size, "intermediate_size rows")
    if config.pp_size > 1:
        split_layers(mc.num_layers, config.pp_size)
    if config.quantization and config.tp_size > 1:
        raise EngineError("tensor parallelism does not support quantized models yet; serve "
                          "without --quantization or with --tp-size 1.")
