"""``engine serve``'s server for an Engine built in the test's own process (``InProcessServer``),
for tests that inject faults into the engine or its runtime; the subprocess one is the
product's ``engine.server.process.ServerProcess``."""

from __future__ import annotations


class InProcessServer:
    """``engine serve``'s server for an Engine built in this process, on uvicorn in a thread,
    on 127.0.0.1 and a free port: for tests that inject faults into the engine or its runtime
    (``.engine``, ``.runtime``) and talk to it with a real HTTP client. A context manager."""

    def __init__(self, engine, served_model_name: str = "tiny", grace_period: float = 5.0):
        import socket
        import threading

        from engine.server.launch import build_server
        from engine.server.serving import ServerSettings

        self.engine = engine
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        settings = ServerSettings(str(engine.checkpoint.path), served_model_name, port=port,
                                  shutdown_grace_period=grace_period)
        self.server = build_server(engine, settings, log_level="warning")
        self.runtime = self.server.runtime
        self._thread = threading.Thread(target=self.server.run,
                                        kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> "InProcessServer":
        import time

        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        return self

    def on_engine(self, fn, timeout: float = 30.0):
        """``fn(engine)`` run on the engine thread between two steps (as the routes do); its
        result. Call it from any thread but the server's."""
        import asyncio

        future = asyncio.run_coroutine_threadsafe(self.runtime.call(fn), self.runtime.loop)
        return future.result(timeout)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._socket.close()
