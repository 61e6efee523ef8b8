"""Run the server on uvicorn in this process: the engine loop on its own thread, graceful stop.

On SIGTERM / SIGINT: stop accepting connections, refuse new requests on open ones (503), let
in-flight requests finish for up to the grace period, abort what is left, exit 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import uvicorn

from engine.server.app import build_app
from engine.server.metrics import ServerMetrics
from engine.server.runtime import EngineRuntime
from engine.server.serving import ServerSettings
from engine.server.trace import TraceRecorder

logger = logging.getLogger("engine.server")


class GracefulServer(uvicorn.Server):
    """uvicorn that marks ``owner.draining`` on SIGTERM/SIGINT (logging ``on_signal`` once) and
    exits 0 after its graceful stop. ``owner``: the engine runtime, or the dp front's router."""

    def __init__(self, config: uvicorn.Config, owner, on_signal: str):
        super().__init__(config)
        self.owner, self.on_signal = owner, on_signal

    @property
    def runtime(self):
        return self.owner

    def handle_exit(self, sig, frame) -> None:
        if not self.owner.draining:
            logger.info(f"signal {signal.Signals(sig).name}: {self.on_signal}")
        self.owner.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises the signal after its graceful shutdown, so the process would report
        # "killed by SIGTERM"; a completed graceful stop is a success, so install the handlers
        # without re-raising.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


def build_server(engine, settings: ServerSettings, log_level: str = "info") -> GracefulServer:
    """The uvicorn server for ``engine`` (its ``runtime`` attribute is the engine loop); its
    ``run()`` serves until a signal (or ``should_exit``) stops it."""
    metrics = ServerMetrics(settings.served_model_name)
    metrics.started(engine)
    trace = TraceRecorder(settings.record_trace) if settings.record_trace else None
    runtime = EngineRuntime(engine, metrics, engine.config.max_queued_requests, trace)
    app = build_app(runtime, settings, metrics)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            access_log=log_level == "debug",
                            timeout_graceful_shutdown=settings.shutdown_grace_period,
                            lifespan="on")
    return GracefulServer(config, runtime, f"draining (grace period "
                                           f"{settings.shutdown_grace_period:g} s)")


def serve(engine, settings: ServerSettings, log_level: str = "info") -> None:
    """Serve ``engine`` over HTTP until a signal stops it. The engine loop runs on this thread
    (the one that loaded the model: see EngineRuntime.use_caller_thread), uvicorn's event loop
    on another; SIGTERM / SIGINT reach this thread and start uvicorn's graceful stop."""
    server = build_server(engine, settings, log_level)
    runtime = server.runtime
    logger.info(f"serving '{settings.served_model_name}' on http://{settings.host}:"
                f"{settings.port}")
    main = threading.current_thread() is threading.main_thread()
    if main:
        runtime.use_caller_thread()
    http = threading.Thread(target=server.run, name="http", daemon=True)
    old = {s: signal.signal(s, server.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)} \
        if main else {}
    try:
        http.start()
        if main:
            runtime.run_here(stop_when=lambda: not http.is_alive())
        while http.is_alive():
            http.join(0.2)  # (a bare join would hold off the signal handlers)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        engine.close()  # the tp/pp workers, if any
    logger.info("server stopped")
