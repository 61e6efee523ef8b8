"""``engine serve --dp-size N``: start the replicas, serve the front on uvicorn until a signal,
then stop the replicas (each drains its in-flight requests for the grace period)."""

from __future__ import annotations

import logging

import uvicorn

from engine.plugins import get_registries
from engine.router.front import Router, build_front_app
from engine.router.policy import RouterOptions
from engine.router.replicas import ReplicaSet
from engine.server.launch import GracefulServer

logger = logging.getLogger("engine.router")


def serve_dp(replica_args: list[str], options: RouterOptions, policy_name: str, host: str,
             port: int, api_key: str | None, grace: float, log_level: str = "info") -> None:
    """Serve ``options.dp_size`` replicas of ``engine serve <replica_args>`` behind one front
    on ``host``:``port``, routed by the registered routing policy ``policy_name``."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    factory = get_registries().routing.get(policy_name).obj
    policy = factory(options)
    replicas = ReplicaSet(options.dp_size, replica_args)
    replicas.start()
    try:
        replicas.wait_ready()
        router = Router(replicas, policy, options, policy_name, api_key)
        app = build_front_app(router, host, port)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                access_log=log_level == "debug",
                                timeout_graceful_shutdown=grace, lifespan="on")
        logger.info(f"dp front: {options.dp_size} replicas behind http://{host}:{port}, "
                    f"router policy {policy_name}")
        GracefulServer(config, router, "draining the dp front, then its replicas").run()
    finally:
        replicas.stop(grace)
        logger.info("dp front stopped")
