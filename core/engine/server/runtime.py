"""The engine loop on its own thread, bridged to asyncio.

Only the engine thread touches the Engine's scheduler and KV pool; the HTTP side sends it jobs
through a thread-safe queue. The engine thread only schedules: prompts are templated and
tokenized before they reach it, on the tokenizer threads (SGLang's TokenizerManager:
``submit``), and the text of what it generates is made after it, on the detokenizer thread
(SGLang's DetokenizerManager: engine.server.detokenize), which hands the token deltas to the
event loop through ``call_soon_threadsafe``, one call per step for all requests. The engine
thread decodes only for requests with stop strings (a window of a few tokens per token, to
find them). So neither a slow forward nor a long prompt or template blocks the other side.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.scheduler.request import Status
from engine.server.detokenize import DetokenizerThread
from engine.server.handle import Delta, Handle

logger = logging.getLogger("engine.server")
IDLE_WAKE_S = 0.5  # idle ticks keep the throughput gauge falling to zero
# failed steps in a row (no step succeeding in between) after which the engine is declared
# unable to serve (/health 503) instead of failing every new request the same way
MAX_FAILED_STEPS = 3
# threads that template and tokenize prompts (a long prompt or a slow template holds one)
TOKENIZER_THREADS = 4


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class EngineFailed(Exception):
    pass


class EngineRuntime:
    def __init__(self, engine, metrics=None, max_queued_requests: int | None = None,
                 trace=None):
        self.engine = engine
        self.metrics = metrics
        self.trace = trace  # TraceRecorder (--record-trace), or None
        self.max_queued = max_queued_requests
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.failed: str | None = None
        self._closed = False  # set by the engine thread as it leaves: no job will run again
        self._pending: set[asyncio.Future] = set()  # call()s not answered yet (event loop only)
        self._failed_steps = 0
        self._jobs: queue.SimpleQueue[Callable[[], Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._live: dict = {}  # Req -> (Handle, index)
        self._pieces: dict[int, str] = {}
        self._thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)
        # run_here(): the engine loop on the caller's thread (serve()'s main thread) instead
        self._on_caller = False
        self._go, self._done = threading.Event(), threading.Event()
        self._running = False
        self._tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenizer")
        self._detok = DetokenizerThread(engine, self.pieces,
                                        metrics.itl if metrics is not None else None)

    # -- the HTTP side (event loop thread) ------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._detok.start(loop)
        if self._on_caller:
            self._running = True
            self._go.set()  # run_here() starts the loop
        else:
            self._thread.start()

    def use_caller_thread(self) -> None:
        """Before ``start``: the engine loop is to run on the thread that calls ``run_here``
        (serve() gives it the main thread, the one that loaded the model), not on a thread of
        its own. On a CPU that matters: OpenMP keeps one pool of worker threads per thread that
        opens parallel regions, and with two pools (the loader's, the loop's) on a machine
        with as many cores as workers, libgomp stops spinning between regions, and every
        small matmul waits for a futex wake-up: a SmolLM2 decode step took 21 ms on a second
        thread against 10.5 ms on the loading one (2-core Zen 4)."""
        self._on_caller = True

    def run_here(self, stop_when: Callable[[], bool]) -> None:
        """Run the engine loop on this thread once ``start`` was called (the event loop's
        startup), until ``stop`` (its shutdown); returns early if ``stop_when()`` says the
        HTTP side is gone without starting it."""
        while not self._go.wait(0.1):
            if stop_when():
                return
        try:
            self._main()
        finally:
            self._running = False
            self._done.set()

    @property
    def alive(self) -> bool:
        gone = getattr(self.engine, "failure", None)  # a tp/pp rank is gone, maybe idle
        if self.failed is None and gone:
            self.failed = gone
        running = self._running if self._on_caller else self._thread.is_alive()
        return running and self.failed is None and not self._closed

    async def call(self, fn: Callable[[Any], Any]):
        """Run ``fn(engine)`` on the engine thread between two steps; returns its result.
        EngineFailed if the engine loop is down, or goes down before it runs ``fn``."""
        if not self.alive:
            raise EngineFailed(self.failed or "the engine loop is not running")
        loop, fut = self.loop, self.loop.create_future()

        def job():
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - handed to the awaiting request
                result, error = None, e
            loop.call_soon_threadsafe(_settle, fut, result, error)

        # no await between the alive check and here: either the engine thread is still to
        # leave, and then _fail_pending (queued by it on this loop) answers ``fut``, or it left
        # and ``alive`` said so above
        self._pending.add(fut)
        try:
            self._jobs.put(job)
            self._wake.set()
            return await fut
        finally:
            self._pending.discard(fut)

    async def submit(self, items: list[tuple[Handle, Callable[[Any], tuple]]]) -> None:
        """Queue several prompts at once, all or none. Each ``prepare(engine) -> (prompt ids,
        SamplingParams)`` (chat template, tokenizer, checks) runs on a tokenizer thread, never
        on the engine thread, which only queues the prepared requests. A prompt whose
        max_new_tokens is 0 is only checked (echo / scoring), never run."""
        if self.draining:
            raise ShuttingDown("the server is shutting down; retry on another replica")
        if not self.alive:
            raise EngineFailed(self.failed or "the engine loop is not running")

        def prepare_all():
            engine = self.engine
            out = [(handle, *prepare(engine)) for handle, prepare in items]
            for _, ids, params in out:
                engine.check_request(ids, params)
            return out

        prepared = await self.loop.run_in_executor(self._tokenizers, prepare_all)

        def add(engine):
            new = sum(p.n for _, _, p in prepared if p.max_new_tokens > 0)
            waiting = len(engine.scheduler.waiting)
            if self.max_queued is not None and new and waiting + new > self.max_queued:
                raise QueueFull(f"the queue is full ({waiting} waiting, --max-queued-requests "
                                f"{self.max_queued}); retry later")
            for handle, ids, params in prepared:
                handle.prompt_ids = list(ids)
                if params.max_new_tokens == 0 and handle.prompt_logprobs is None:
                    continue  # echo alone: nothing to run
                handle.reqs = engine.add_request(ids, params, rid=handle.rid,
                                                 stream=handle.stream,
                                                 constraint=handle.constraint,
                                                 prompt_logprobs=handle.prompt_logprobs)
                handle.started(handle.reqs)
                for i, r in enumerate(handle.reqs):
                    self._live[r] = (handle, i)

        await self.call(add)

    def pieces(self, ids) -> dict[int, str]:
        """The text of each token alone (for logprobs); any thread (a racing decode of the
        same token writes the same text)."""
        for t in ids:
            if t not in self._pieces:
                self._pieces[t] = self.engine.tokenizer.decode([t])
        return {t: self._pieces[t] for t in ids}

    def abort(self, handle: Handle) -> None:
        """Abort what is left of ``handle`` (the client went away); never blocks."""
        if not self.alive:
            return

        def job():
            for r in handle.reqs:
                if self._live.pop(r, None) is not None:
                    self.engine.abort(r)

        self._jobs.put(job)
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._on_caller:
            if self._go.is_set():
                self._done.wait(timeout)
        elif self._thread.is_alive():
            self._thread.join(timeout)
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

    # -- the engine thread -------------------------------------------------------------------------
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
        scheduler = self.engine.scheduler
        while not self._stop and self.failed is None:
            self._wake.clear()
            ran = self._run_jobs()
            if scheduler.has_work:
                try:
                    touched = self.engine.step()
                except Exception as e:  # a bug, not a bad request: fail loudly, keep serving
                    self._step_failed(e)
                else:
                    self._failed_steps = 0
                    self._publish(touched)
            elif not ran:
                self._wake.wait(IDLE_WAKE_S)
            if self.metrics is not None:
                self.metrics.sync(scheduler)

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


    def _fail_pending(self, message: str) -> None:
        """Event loop thread: answer every call() the engine thread will never run."""
        for fut in list(self._pending):
            _settle(fut, None, EngineFailed(message))


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():  # the awaiting request was cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)

