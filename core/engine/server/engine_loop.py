"""What runs on the engine thread of an EngineRuntime (server/runtime.py): the loop that runs
the jobs the HTTP side queued between two steps, steps the engine, hands each step's tokens to
the detokenizer thread, and recovers from a failed step (or declares the engine down)."""

from __future__ import annotations

import logging
import queue
import time

from engine.scheduler.request import Status
from engine.server.handle import Delta

logger = logging.getLogger("engine.server")
IDLE_WAKE_S = 0.5  # idle ticks keep the throughput gauge falling to zero
# a data-parallel attention rank with nothing to run checks this often whether another rank
# runs a forward it must take part in (engine/parallel/dp_attention.py)
DP_IDLE_WAKE_S = 0.002
# failed steps in a row (no step succeeding in between) after which the engine is declared
# unable to serve (/health 503) instead of failing every new request the same way
MAX_FAILED_STEPS = 3


class EngineLoop:
    """The engine-thread half of EngineRuntime (mixed into it; its state is set up there: the
    job queue and wake event, the live requests, the detokenizer thread, the failure count)."""

    def _main(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug: say so on /health rather than hang every request
            logger.exception("the engine loop crashed")
            self.failed = f"the engine loop crashed: {type(e).__name__}: {e}"
        self._closed = True
        message = self.failed or "the server is shutting down"
        self._fail_all(message, reason="error" if self.failed else "abort")
        self._detok.close()  # after delivering what is queued
        if self.trace is not None:
            self.trace.close()
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._fail_pending, message)

    def _serve(self) -> None:
        scheduler, runner = self.engine.scheduler, self.engine.runner
        # --enable-dp-attention: every rank takes part in every rank's forward (dp_idle)
        dp = getattr(runner, "dp", None) is not None
        while not self._stop and self.failed is None:
            self._wake.clear()
            ran = self._run_jobs()
            if scheduler.has_work:
                forwards = runner.forwards
                try:
                    touched = self.engine.step()
                except Exception as e:  # a bug, not a bad request: fail loudly, keep serving
                    self._step_failed(e)
                else:
                    self._failed_steps = 0
                    self._publish(touched)
                    if dp and runner.forwards == forwards:  # a step with no forward here
                        self._dp_idle()
            elif dp:
                if not self._dp_idle() and not ran:
                    self._wake.wait(DP_IDLE_WAKE_S)
            elif not ran:
                self._wake.wait(IDLE_WAKE_S)
            if self.metrics is not None:
                self.metrics.sync(scheduler)

    def _dp_idle(self) -> bool:
        """This rank's part in the other data-parallel attention ranks' forward (ModelRunner.
        dp_idle). The ranks' collectives fail once another rank is gone: on the way out
        (draining or stopping, the ranks leave together) that is the end of the loop;
        otherwise the engine cannot serve any more (/health 503), said once with the reason
        rather than as a crash."""
        try:
            return self.engine.runner.dp_idle()
        except RuntimeError as e:
            if not (self._stop or self.draining):
                self.failed = (f"the engine cannot serve: another data-parallel attention rank "
                               f"is gone ({str(e).splitlines()[0][:200]}); every rank must run, "
                               f"so restart the engine")
                logger.error(self.failed)
            self._stop = True
            return False

    def _step_failed(self, e: Exception) -> None:
        """Abort every request in flight with the error, then make sure the engine can go on:
        nothing left queued or running and every KV slot free again (the prefix cache is
        emptied: the failed step may have left anything in it). If that does not hold, or
        MAX_FAILED_STEPS steps failed in a row, the engine is declared down (/health 503)."""
        self._failed_steps += 1
        what = f"{type(e).__name__}: {e}"
        if getattr(e, "fatal", False):  # nothing to recover: a tp/pp rank is gone
            logger.error(f"engine step failed: {e}")
            self.failed = str(e)
            self._fail_all(str(e))
            return
        logger.exception(f"engine step failed ({what}); aborting every request in flight")
        self._fail_all(f"internal error in the engine step ({what}); the request was aborted "
                       f"(see the server log)")
        problem = self._reset_after_failure()
        if problem is None and self._failed_steps >= MAX_FAILED_STEPS:
            problem = f"{self._failed_steps} engine steps in a row failed (the last: {what})"
        if problem is not None:
            self.failed = f"the engine cannot serve: {problem}"
            logger.error(self.failed)
        else:
            logger.warning("the engine recovered from the failed step: no request in flight, "
                           "every KV slot free, prefix cache emptied")

    def _reset_after_failure(self) -> str | None:
        """None when the engine is back to an empty, consistent state; else what is wrong."""
        scheduler = self.engine.scheduler
        pool = scheduler.kv.pool
        try:
            for r in [*scheduler.running, *scheduler.waiting]:  # not ours: none are expected
                self.engine.abort(r)
            if scheduler.kv.cache is not None and not self.engine.flush_cache():
                return "the prefix cache could not be emptied after the failed step"
        except Exception as e:  # noqa: BLE001 - reported as the reason the engine is down
            return f"cleaning up after the failed step raised {type(e).__name__}: {e}"
        if scheduler.has_work or pool.free_slots != pool.size or pool.free_reqs != pool.max_reqs:
            return (f"the KV pool did not come back after the failed step ({pool.free_slots} "
                    f"of {pool.size} slots and {pool.free_reqs} of {pool.max_reqs} request "
                    f"rows free with nothing running)")
        return None

    def _run_jobs(self) -> bool:
        ran = False
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            try:
                job()
            except Exception:  # call() hands its own errors over; this is an abort failing
                logger.exception("an engine-thread job failed")

    def _publish(self, touched) -> None:
        """Hand what the step produced to the detokenizer thread: per request only its number
        of output tokens and whether it finished (engine.server.handle.Step); the slices, the
        text and the inter-token latencies are made there."""
        now, out = time.monotonic(), []
        live = self._live
        get = live.get
        finished = Status.FINISHED
        for r in touched:
            entry = get(r)
            if entry is None:
                continue
            if r.status is finished:
                del live[r]
                if self.trace is not None:
                    self.trace.record(r)
                out.append((entry, r, len(r.output_ids), True))
            else:
                out.append((entry, r, len(r.output_ids), False))
        if out:
            self._detok.put(out, now)

    def _fail_all(self, message: str, reason: str = "error") -> None:
        out = []
        for r, (handle, i) in list(self._live.items()):
            try:
                self.engine.abort(r)
            except Exception:
                logger.exception(f"could not abort {r.rid}")
            out.append((handle, Delta(i, "", [], finish_reason=reason,
                                      completion_tokens=len(r.output_ids), error=message)))
        self._live.clear()
        if out:  # behind the deltas the detokenizer thread has not delivered yet
            self._detok.put(out)
