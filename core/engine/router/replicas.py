"""The dp replicas: N child ``engine serve`` processes on 127.0.0.1 and free ports, their log
lines prefixed with their dp rank, their deaths noticed and reported."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from engine.net import free_port

logger = logging.getLogger("engine.router")

# the child runs the same CLI as this process
_CLI = "import sys; from engine_cli.main import cli; sys.argv[0] = 'engine'; cli()"


def _die_with_parent() -> None:
    """A replica must not outlive the front, even when the front is SIGKILLed (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass(eq=False)
class Replica:
    rank: int
    port: int
    proc: subprocess.Popen | None = None
    load: int = 0  # requests in flight through the front
    routed: int = 0  # requests the front sent it
    alive: bool = True
    error: str | None = None  # why it is out of rotation
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def mark_dead(self, reason: str) -> bool:
        """Take it out of rotation; True the first time (the caller reports it)."""
        with self._lock:
            if not self.alive:
                return False
            self.alive, self.error = False, reason
        logger.error(f"dp rank {self.rank} ({self.url}) is down: {reason}; it is out of "
                     f"rotation and its traffic moves to the other replicas")
        return True


class ReplicaSet:
    """Starts ``dp_size`` replicas of ``engine serve <args>``; ``stop()`` ends them."""

    def __init__(self, dp_size: int, args: list[str]):
        self.replicas = [Replica(rank, free_port()) for rank in range(dp_size)]
        self.args = args

    def start(self) -> None:
        for r in self.replicas:
            cmd = [sys.executable, "-c", _CLI, "serve", *self.args, "--host", "127.0.0.1",
                   "--port", str(r.port)]
            r.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      preexec_fn=_die_with_parent, env=dict(os.environ))
            threading.Thread(target=_relay, args=(r,), daemon=True,
                             name=f"dp{r.rank}-log").start()
            logger.info(f"dp rank {r.rank}: started pid {r.proc.pid} on {r.url}")

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until every replica answers /health 200; RuntimeError naming the replica that exited
        (or did not come up within ``timeout`` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(self.replicas)
        while pending:
            for r in list(pending):
                code = r.proc.poll()
                if code is not None:
                    raise RuntimeError(f"dp rank {r.rank} exited with code {code} while "
                                       f"starting (its log lines are above, prefixed "
                                       f"'[dp{r.rank}]')")
                try:
                    if httpx.get(r.url + "/health", timeout=2).status_code == 200:
                        pending.remove(r)
                        logger.info(f"dp rank {r.rank} is ready")
                except httpx.HTTPError:
                    pass
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"dp rank(s) {[r.rank for r in pending]} not ready after "
                                   f"{timeout:g} s")
            if pending:
                time.sleep(0.2)

    def check_exits(self) -> None:
        """Take every replica whose process exited out of rotation (called periodically)."""
        for r in self.replicas:
            code = r.proc.poll() if r.proc else None
            if r.alive and code is not None:
                how = (f"killed by {signal.Signals(-code).name}" if code < 0
                       else f"exited with code {code}")
                r.mark_dead(f"process {r.proc.pid} {how}")

    def exited(self, r: Replica, timeout: float) -> bool:
        """Whether ``r``'s process exits within ``timeout`` s (then it is out of rotation)."""
        try:
            r.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        self.check_exits()
        return True

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def stop(self, grace: float) -> None:
        """SIGTERM every replica (each drains its in-flight requests for ``grace`` s), then
        SIGKILL the ones still running after ``grace`` + 10 s."""
        procs = [r.proc for r in self.replicas if r.proc and r.proc.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace + 10
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error(f"replica pid {p.pid} still running {grace + 10:g} s after "
                             f"SIGTERM; killing it")
                p.kill()
                p.wait(10)


def _relay(r: Replica) -> None:
    """Copy a replica's output to this process's stderr, each line prefixed with its rank."""
    for line in iter(r.proc.stdout.readline, b""):
        sys.stderr.write(f"[dp{r.rank}] " + line.decode(errors="replace"))
        sys.stderr.flush()
