"""A tp/pp rank other than 0: join, build this rank's shard, then do what rank 0 says, in
lockstep with it (``python -m engine.ranks.worker RANK SPEC``, started by launch.py).

Messages (broadcast by rank 0 on the control group): ``("kv_pool", kwargs)`` sizes the pool
like rank 0's; ``("graphs", sizes)`` captures the same CUDA graphs; ``("forward",
BatchMessage)`` runs the batch (its micro-batches through this rank's stage); ``("stop",
None)`` ends the worker. Anything that goes wrong is written to the store for rank 0 to name
this rank with, and the worker exits (it never outlives rank 0: see rendezvous.start_heartbeat)."""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.device import detect_device
from engine.hicache.copier import replay_copies
from engine.models import default
from engine.models.checkpoint import open_checkpoint
from engine.models.config import ModelConfig
from engine.plugins import get_registries
from engine.ranks import rendezvous
from engine.ranks.pipeline import run_stage
from engine.ranks.world import RankContext, join_world, set_threads, topology
from engine.registry import resolve_parallel_strategy
from engine.runner import build_runner

logger = logging.getLogger("engine.parallel")


def build_rank(config, rank: int, store, resolved: dict):
    """(RankContext, ModelRunner) of ``rank``, with the names rank 0 resolved (``resolved``:
    attention_backend, quantization, page_size)."""
    topo = topology(config)
    regs = get_registries()
    if config.device != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(rank % topo.per_node)
    device = detect_device(config.device)
    set_threads(topo, device)
    strategy = resolve_parallel_strategy(regs, config.parallel_strategy, device).obj
    ckpt = open_checkpoint(config.model or default.default_model_path())
    mc = ModelConfig.from_checkpoint(ckpt, regs.models)
    ctx = join_world(config, topo, rank, store, strategy, mc.num_layers)
    quant = resolved["quantization"]
    runner = build_runner(config, ckpt, regs, device, regs.attention.get(resolved["attention"]),
                          regs.kv_dtypes.get(config.kv_cache_dtype),
                          regs.quantization.get(quant) if quant else None, ctx.tp, ctx.stage)
    return ctx, runner


def serve_rank(ctx: RankContext, runner, config=None) -> None:
    """Report this rank's sizes to rank 0, then follow its messages until ``stop``."""
    dist.gather_object((runner.weight_bytes, runner.kv_bytes_per_token()), None, dst=0,
                       group=ctx.control)
    forwards = 0
    host = None  # HiCache: this rank's host tier (made with rank 0's first copy)
    storage = None  # and its shard of the storage tier (hicache/shards.py)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=ctx.control)
        kind, payload = box[0]
        if kind == "forward":
            table = runner.kv_pool.req_to_token
            payload.apply_edits(table)  # a table out of step with rank 0's is fatal
            if payload.copies:  # HiCache: rank 0's copies, in this rank's own tiers
                host = replay_copies(runner.kv_pool, host, payload.copies, storage)
            forwards += 1
            error = None
            try:
                run_stage(runner, ctx.topo, ctx.rank, payload.batches(table),
                          payload.return_all_logits)
            except Exception as e:  # noqa: BLE001 - an OOM, say: that batch fails, not the rank
                error = f"{type(e).__name__}: {e}"
                logger.warning(f"{ctx.topo.describe(ctx.rank)}: forward {forwards} failed "
                               f"({error}); waiting for rank 0's next message")
            rendezvous.report_forward(ctx.store, ctx.rank, forwards, error)
        elif kind == "kv_pool":
            runner.init_kv_pool(**payload)
        elif kind == "graphs":
            runner.init_cuda_graphs(payload)
        elif kind == "hicache_storage":
            from engine.hicache.build import build_rank_pages

            storage, sent = build_rank_pages(config, runner, ctx.topo, ctx.rank, payload)
            dist.gather_object(sent, None, dst=0, group=ctx.control)
        elif kind == "hicache_flush":
            if payload:
                host = replay_copies(runner.kv_pool, host, payload, storage)
            if storage is not None:
                storage.flush()
            dist.gather_object(None, None, dst=0, group=ctx.control)
        elif kind == "stop":
            if storage is not None:
                storage.close()
            return
        else:
            raise RuntimeError(f"unknown message from rank 0: {kind!r}")


def run(config, rank: int, host: str, port: int, resolved: dict) -> None:
    """The whole life of a worker rank; exits the process when it fails."""
    topo = topology(config)
    store = rendezvous.open_store(host, port, False, config.dist_timeout)
    rendezvous.start_heartbeat(store, rank)
    try:
        ctx, runner = build_rank(config, rank, store, resolved)
        logger.info(f"{topo.describe(rank)} ready: weights {runner.weight_bytes / (1 << 20):.1f} "
                    f"MiB, KV {runner.kv_bytes_per_token()} bytes/token")
        serve_rank(ctx, runner, config)
    except BaseException as e:  # noqa: BLE001 - named to rank 0, then the process ends
        message = f"{type(e).__name__}: {e}"
        rendezvous.report_error(store, rank, message)
        logger.error(f"{topo.describe(rank)} failed: {message}\n{traceback.format_exc()}")
        os._exit(1)
    logger.info(f"{topo.describe(rank)}: stopped by rank 0")
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    rank, spec = int(argv[0]), json.loads(argv[1])
    config = EngineConfig(**spec["config"])
    topo = topology(config)
    logging.basicConfig(level=spec["log_level"].upper(),
                        format=f"[%(asctime)s {topo.short(rank)}] %(message)s")
    config.attention_backend = spec["resolved"]["attention"]
    config.page_size = spec["resolved"]["page_size"]
    run(config, rank, spec["host"], spec["port"], spec["resolved"])
    # stopped cleanly: end here rather than in the interpreter's teardown, where the daemon
    # heartbeat thread may still be inside the store's C++ client as it is destroyed (a worker
    # once aborted there: "terminate called without an active exception")
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
