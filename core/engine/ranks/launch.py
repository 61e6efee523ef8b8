"""Starting the ranks of ``--tp-size`` x ``--pp-size`` (over ``--nnodes``): node 0's engine
process is rank 0; it hosts the store (rendezvous.py), checks the other nodes, starts its
node's other ranks as ``python -m engine.ranks.worker`` processes, joins the process group
with them and builds its shard. Another node (``engine serve --node-rank N``) starts its ranks
the same way and serves as a worker itself: no scheduler, no HTTP."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import asdict

from engine.errors import EngineError
from engine.models import deepseek, default, moe
from engine.models.checkpoint import open_checkpoint
from engine.models.config import ModelConfig
from engine.parallel.shard import rank_head_counts, split_evenly
from engine.parallel.stage import split_layers
from engine.plugins import get_registries
from engine.ranks import rendezvous, worker
from engine.ranks.executor import ParallelRunner
from engine.ranks.world import exited, join_world, set_threads, stop_processes, topology
from engine.runner import build_runner

logger = logging.getLogger("engine.parallel")
# how a worker rank is started: `python <this> RANK SPEC` (tests put a failing script here)
WORKER_COMMAND = ["-m", "engine.ranks.worker"]


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


def start_rank0(config, checkpoint, model_config, regs, device, strategy, entries: dict,
                agreed: dict):
    """Node 0: host the store, check the other nodes, start this node's other ranks, join
    them, and build rank 0's shard. ``entries``: the resolved attention, kv and quant entries;
    ``agreed``: node 0's fingerprint (rendezvous.fingerprint, of the flags as given).
    Returns the ParallelRunner the engine uses as its runner."""
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
    mc = model_config
    problem = (deepseek if mc.mla is not None else moe).parallel_problem(
        mc, config.tp_size, config.ep_size)
    if problem:
        raise EngineError(problem)
    if config.tp_size > 1:
        rank_head_counts(mc.num_heads, mc.num_kv_heads, config.tp_size)
        if not all(mc.is_moe_layer(i) for i in range(mc.num_layers)):  # a dense MLP to cut
            split_evenly(mc.intermediate_size, config.tp_size, "intermediate_size rows")
    if config.pp_size > 1:
        split_layers(mc.num_layers, config.pp_size)
    if config.quantization and config.tp_size > 1:
        raise EngineError("tensor parallelism does not support quantized models yet; serve "
                          "without --quantization or with --tp-size 1.")
