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
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.server.detokenize import DetokenizerThread
from engine.server.engine_loop import MAX_FAILED_STEPS, EngineLoop  # noqa: F401 (tests)
from engine.server.handle import Handle

# threads that template and tokenize prompts (a long prompt or a slow template holds one)
TOKENIZER_THREADS = 4


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class EngineFailed(Exception):
    pass


class EngineRuntime(EngineLoop):
    """The engine loop's thread (engine/server/engine_loop.py: what runs there) and the HTTP
    side's ways into it (this file: jobs, prepared requests, aborts), for one Engine."""

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

