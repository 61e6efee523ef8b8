"""The dp replicas: N child ``engine serve`` processes on 127.0.0.1 and free ports, their log
lines prefixed with their dp rank, their deaths noticed and reported, and their restarts.

Each replica gets its share of the machine (router/placement.py). The API key goes through the
environment (``ENGINE_API_KEY``), never the command line, which anyone on the machine can read
in /proc.

A replica whose process exits is restarted after a backoff (1 s, doubling, up to 30 s), at most
``max_restarts`` times in a row (a replica that stayed up ``STABLE_S`` s starts counting again),
and comes back into rotation once its /health answers 200 (:meth:`Router.monitor`).
"""

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
from engine.router.placement import Placement, place  # noqa: F401 (tests import place here)

logger = logging.getLogger("engine.router")

# the child runs the same CLI as this process
_CLI = "import sys; from engine_cli.main import cli; sys.argv[0] = 'engine'; cli()"
API_KEY_ENV = "ENGINE_API_KEY"  # `engine serve --api-key`'s variable
MAX_RESTARTS = 5
RESTART_BACKOFF_S = 1.0  # doubles with each restart in a row
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # up this long after a restart: the next death counts from 1 again


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
    alive: bool = True  # in rotation
    error: str | None = None  # why it is out of rotation
    restarts: int = 0  # processes started after the first
    failures: int = 0  # deaths in a row (reset once it stayed up STABLE_S)
    restart_at: float | None = None  # monotonic time of the restart scheduled
    gave_up: bool = False  # dead for good: max_restarts reached
    up_since: float | None = None
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

    def mark_healthy(self) -> None:
        """Its process answers /health 200: back into rotation (if it was out)."""
        with self._lock:
            if self.alive:
                return
            self.alive, self.error, self.up_since = True, None, time.monotonic()
        logger.warning(f"dp rank {self.rank} ({self.url}, pid {self.proc.pid}) is healthy "
                       f"again: back in rotation")


class ReplicaSet:
    """Starts ``dp_size`` replicas of ``engine serve <args>``; ``stop()`` ends them.
    ``placements``: each replica's share (:func:`place`; None: nothing added);
    ``api_key``: passed in each replica's environment; ``cmd``: the command line of a replica
    on a port (tests start something else)."""

    def __init__(self, dp_size: int, args: list[str], api_key: str | None = None,
                 placements: list[Placement] | None = None, max_restarts: int = MAX_RESTARTS,
                 backoff_s: float = RESTART_BACKOFF_S, cmd=None, together: bool = False):
        self.replicas = [Replica(rank, free_port()) for rank in range(dp_size)]
        self.args, self.api_key = args, api_key
        self.placements = placements or [Placement({}, [], "") for _ in range(dp_size)]
        self.max_restarts, self.backoff_s = max_restarts, backoff_s
        self.cmd = cmd or (lambda args, port: [sys.executable, "-c", _CLI, "serve", *args,
                                               "--host", "127.0.0.1", "--port", str(port)])
        self.stopping = False
        # --enable-dp-attention: every replica takes part in every forward, so once one is
        # gone for good none can serve (``live`` is empty, ``down_reason`` says why)
        self.together = together

    def start(self) -> None:
        for r in self.replicas:
            if self.placements[r.rank].note:
                logger.info(f"dp rank {r.rank} gets {self.placements[r.rank].note}")
            self._spawn(r)

    def _spawn(self, r: Replica) -> None:
        placement = self.placements[r.rank]
        env = {**os.environ, **placement.env}
        env.pop(API_KEY_ENV, None)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        r.proc = subprocess.Popen(self.cmd([*self.args, *placement.args], r.port),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                  preexec_fn=_die_with_parent, env=env)
        threading.Thread(target=_relay, args=(r.rank, r.proc), daemon=True,
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
                        r.up_since = time.monotonic()
                        logger.info(f"dp rank {r.rank} is ready")
                except httpx.HTTPError:
                    pass
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"dp rank(s) {[r.rank for r in pending]} not ready after "
                                   f"{timeout:g} s")
            if pending:
                time.sleep(0.2)

    def check_exits(self) -> None:
        """Take every replica whose process exited out of rotation, and schedule its restart
        (called periodically)."""
        now = time.monotonic()
        for r in self.replicas:
            code = r.proc.poll() if r.proc else None
            if code is None or r.restart_at is not None or r.gave_up:
                continue
            how = (f"killed by {signal.Signals(-code).name}" if code < 0
                   else f"exited with code {code}")
            if not r.mark_dead(f"process {r.proc.pid} {how}"):  # already out of rotation
                r.error = f"process {r.proc.pid} {how}"
                logger.error(f"dp rank {r.rank} ({r.url}): {r.error}")
            if self.stopping:
                continue
            if r.up_since is not None and now - r.up_since >= STABLE_S:
                r.failures = 0
            r.up_since = None
            if r.failures >= self.max_restarts:
                r.gave_up = True
                r.error = (f"{r.error}; not restarted: it died {r.failures} time(s) in a row "
                           f"(at most {self.max_restarts} restarts)")
                logger.error(f"dp rank {r.rank}: giving up after {r.failures} restart(s) in a "
                             f"row; it stays out of rotation")
                if self.together:
                    logger.error(self.down_reason())
                continue
            delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** r.failures)
            r.failures += 1
            r.restart_at = now + delay
            logger.warning(f"dp rank {r.rank}: restarting it in {delay:g} s (restart "
                           f"{r.failures} of at most {self.max_restarts} in a row)")

    def restart_due(self) -> None:
        """Start the replicas whose restart time has come (out of rotation until healthy)."""
        now = time.monotonic()
        for r in self.replicas:
            if r.restart_at is not None and now >= r.restart_at and not self.stopping:
                r.restart_at = None
                r.port = free_port()
                r.restarts += 1
                r.error = f"restarting (restart {r.restarts}), not healthy yet"
                self._spawn(r)

    def recovering(self) -> list[Replica]:
        """Out of rotation with a process running: the ones to probe for health."""
        return [r for r in self.replicas if not r.alive and not r.gave_up and r.proc
                and r.proc.poll() is None and r.restart_at is None]

    def exited(self, r: Replica, timeout: float) -> bool:
        """Whether ``r``'s process exits within ``timeout`` s (then it is out of rotation)."""
        try:
            r.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        self.check_exits()
        return True

    def live(self) -> list[Replica]:
        if self.together and any(r.gave_up for r in self.replicas):
            return []
        return [r for r in self.replicas if r.alive]

    def down_reason(self) -> str:
        """Why nothing can serve (``live`` is empty), for /health and the 503s."""
        gone = [r for r in self.replicas if r.gave_up]
        if self.together and gone:
            r = gone[0]
            return (f"the engine cannot serve: dp attention rank {r.rank} is gone ({r.error}); "
                    f"every rank takes part in every forward and a rank cannot rejoin the "
                    f"others, so restart `engine serve`")
        return "no dp replica is alive (see /get_server_info for why each one stopped)"

    def stop(self, grace: float) -> None:
        """SIGTERM every replica (each drains its in-flight requests for ``grace`` s), then
        SIGKILL the ones still running after ``grace`` + 10 s."""
        self.stopping = True
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


def _relay(rank: int, proc: subprocess.Popen) -> None:
    """Copy a replica's output to this process's stderr, each line prefixed with its rank."""
    for line in iter(proc.stdout.readline, b""):
        sys.stderr.write(f"[dp{rank}] " + line.decode(errors="replace"))
        sys.stderr.flush()
