"""The detokenizer thread (SGLang's DetokenizerManager): turns what the engine thread collected
after each step (engine.server.handle.Out: token ids, logprobs) into Deltas with their text and
hands them to the event loop, so that the engine thread never decodes a streamed or returned
text (only the stop-string check of a request that has stop strings decodes there, a window of
a few tokens, and only for the tokens that might end one of its stop strings).

One thread, fed in step order: a request's deltas reach its handle in order, and error deltas
(``put_ready``) go through the same queue, behind the deltas already collected."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from engine.server.handle import Delta, Step, build_delta, collect

logger = logging.getLogger("engine.server")


class DetokenizerThread:
    def __init__(self, engine, pieces=None, itl=None):
        self.engine = engine
        self.pieces = pieces  # token ids -> {id: text} (logprobs), or None
        self.itl = itl  # the inter-token latency histogram (metrics), or None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="detokenizer", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread.start()

    def put(self, batch: list, now: float | None = None) -> None:
        """Engine thread: a step's ``Step``s (engine.server.handle), made at ``now`` (the
        inter-token latencies are measured from it here, off the engine thread), or ready
        ``(handle, Delta)`` pairs."""
        self._queue.put((batch, now))

    def close(self, timeout: float | None = None) -> None:
        """Deliver what is queued, then stop (engine thread, as it leaves)."""
        self._queue.put(None)
        if timeout is not None and self._thread.is_alive() and \
                threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _main(self) -> None:
        closing = False
        while not closing:
            batches = [self._queue.get()]
            while True:  # behind: everything queued goes to the event loop in one call
                try:
                    batches.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            out = []
            for entry in batches:
                if entry is None:
                    closing = True
                    break
                batch, now = entry
                if now is None:  # (handle, Delta) pairs
                    out += batch
                    continue
                hist = self.itl
                for item in batch:
                    (handle, i), r, n, finished = item
                    last = handle.last_token_time
                    if last[i] is not None and hist is not None:
                        hist.observe(now - last[i])
                    last[i] = now
                    if finished or handle.stream:
                        out.append(self._delta(item))
            if out:
                self._deliver(out)

    def _delta(self, item: Step):
        (handle, i), r, n, finished = item
        try:
            return handle, build_delta(self.engine, collect(handle, i, r, n, finished),
                                       self.pieces)
        except Exception as e:  # a bug: fail this request rather than the thread
            logger.exception("detokenizing a request's output failed")
            return handle, Delta(i, "", [], finish_reason="error", completion_tokens=n,
                                 error=f"internal error while detokenizing: "
                                       f"{type(e).__name__}: {e}")

    def _deliver(self, out: list) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(deliver, out)
        except RuntimeError:  # the loop closed meanwhile
            pass


def deliver(batch) -> None:
    """Event loop: put each delta on its handle's queue."""
    for handle, delta in batch:
        handle.queue.put_nowait(delta)
