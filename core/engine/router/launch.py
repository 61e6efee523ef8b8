"""``engine serve --dp-size N``: start the replicas, serve the front on uvicorn until a signal,
then stop the replicas (each drains its in-flight requests for the grace period)."""

from __future__ import annotations

import dataclasses
import logging

import uvicorn

from engine.plugins import get_registries
from engine.router.front import Router, build_front_app
from engine.router.placement import Placement, place, usable_cpus, visible_gpus, without_flags
from engine.router.policy import RouterOptions
from engine.router.replicas import ReplicaSet
from engine.server.launch import GracefulServer

logger = logging.getLogger("engine.router")


def serve_dp(replica_args: list[str], options: RouterOptions, policy_name: str, host: str,
             port: int, api_key: str | None, grace: float, log_level: str = "info",
             max_request_bytes: int = 32 << 20, config: dict | None = None,
             rank_args: list[list[str]] | None = None) -> None:
    """Serve ``options.dp_size`` replicas of ``engine serve <replica_args>`` behind one front
    on ``host``:``port``, routed by the registered routing policy ``policy_name``. ``config``:
    the replicas' EngineConfig keyword arguments (device, tp/pp sizes, memory fraction), for
    each replica's share of the machine (:func:`replica_placements`). ``rank_args``: what
    each replica's command line gets besides (--enable-dp-attention's ranks: their places
    among each other; such replicas are not restarted, as they cannot rejoin the others)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    factory = get_registries().routing.get(policy_name).obj
    policy = factory(options)
    try:
        placements, replica_args = replica_placements(options.dp_size, replica_args,
                                                      config or {})
    except ValueError as e:  # too few GPUs for a device of their own per replica
        raise RuntimeError(str(e)) from None
    restarts = {}
    if rank_args is not None:
        placements = [dataclasses.replace(p, args=[*p.args, *extra])
                      for p, extra in zip(placements, rank_args)]
        restarts = {"max_restarts": 0, "together": True}
    replicas = ReplicaSet(options.dp_size, replica_args, api_key=api_key, placements=placements,
                          **restarts)
    replicas.start()
    try:
        replicas.wait_ready()
        router = Router(replicas, policy, options, policy_name, api_key, max_request_bytes)
        app = build_front_app(router, host, port)
        server = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                access_log=log_level == "debug",
                                timeout_graceful_shutdown=grace, lifespan="on")
        logger.info(f"dp front: {options.dp_size} replicas behind http://{host}:{port}, "
                    f"router policy {policy_name}")
        GracefulServer(server, router, "draining the dp front, then its replicas").run()
    finally:
        replicas.stop(grace)
        logger.info("dp front stopped")


MEM_FLAGS = ("--mem-fraction-static", "--gpu-memory-utilization")


def replica_placements(dp_size: int, args: list[str], config: dict,
                       gpus: list[str] | None = None, cpus: int | None = None,
                       env=None) -> tuple[list[Placement], list[str]]:
    """Each replica's share of this machine (GPUs of its own, or 1/N of the CPU's threads and
    memory fraction), and the replicas' common arguments (less the memory fraction a CPU
    placement sets per replica). ``gpus``, ``cpus``, ``env``: the machine's, unless given."""
    import os

    if config.get("device") == "cpu":
        gpus = []
    elif gpus is None:
        gpus = visible_gpus()
    per_replica = (config.get("tp_size") or 1) * (config.get("pp_size") or 1)
    fraction = config.get("mem_fraction_static") or config.get("gpu_memory_utilization")
    placements = place(dp_size, per_replica, gpus, cpus or usable_cpus(), fraction,
                       os.environ if env is None else env)
    if any(p.args for p in placements):
        args = without_flags(args, MEM_FLAGS)
    return placements, args
