"""``engine serve`` as a subprocess on 127.0.0.1 and a free port, every wait bounded: what
``engine bench`` starts when it is given server flags instead of a URL (tests and benchmarks
start servers the same way)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from engine.net import free_port


class ServerProcess:
    """A real ``engine serve`` subprocess on 127.0.0.1 and a free port; every wait is bounded.
    ``env``: variables added to this process's."""

    def __init__(self, args: list[str], log_path, api_key: str | None = None,
                 env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        engine = os.path.join(os.path.dirname(sys.executable), "engine")
        cmd = [engine, "serve", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, timeout: float = 90.0) -> "ServerProcess":
        """Until /health answers 200; RuntimeError (with the log) if it exits or times out."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
