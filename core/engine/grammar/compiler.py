"""Compiling constraints off the scheduler's thread: one backend, a small pool of worker
threads, and a cache of compiled grammars keyed by the constraint (its kind and text), so that
every request with the same schema shares one compile, finished or still running."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from engine.interfaces import Constraint, GrammarBackend, GrammarError

COMPILE_WORKERS = 2
CACHE_SIZE = 256  # compiled grammars kept (finished ones are evicted oldest first)


class GrammarCompiler:
    def __init__(self, name: str, backend: GrammarBackend, workers: int = COMPILE_WORKERS,
                 capacity: int = CACHE_SIZE):
        self.name, self.backend, self.capacity = name, backend, capacity
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"grammar-{name}")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # compiles started (cache misses), for tests and stats

    def submit(self, constraint: Constraint) -> Future:
        """The compile of ``constraint`` (started now, or the cached one); thread-safe."""
        if constraint.kind not in self.backend.kinds:
            future: Future = Future()
            future.set_exception(GrammarError(
                f"grammar backend '{self.name}' does not support {constraint.kind} constraints "
                f"(it supports: {', '.join(self.backend.kinds)}); start the server with another "
                f"--grammar-backend", constraint.field))
            return future
        key = (constraint.kind, constraint.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            self.compiles += 1
            future = self._cache[key] = self._pool.submit(self.backend.compile, constraint)
            if len(self._cache) > self.capacity:
                done = [k for k, f in self._cache.items() if f.done()]
                for k in done[: len(self._cache) - self.capacity]:
                    del self._cache[k]
            return future

    def compile(self, constraint: Constraint):
        """Block until ``constraint`` is compiled; GrammarError (naming the constraint's own
        field) when the backend refuses it."""
        return result(self.submit(constraint), constraint)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def result(future: Future, constraint: Constraint):
    """A finished or running compile's grammar, its GrammarError renamed to ``constraint``'s
    field (the cache is shared by requests that gave the same text in different fields)."""
    try:
        return future.result()
    except GrammarError as e:
        raise GrammarError(str(e), constraint.field or e.field) from None


def build_compiler(entry, tokenizer, vocab_size: int) -> GrammarCompiler | None:
    """The resolved ``--grammar-backend`` entry's backend for this tokenizer (None: disabled)."""
    if entry is None:
        return None
    backend = entry.obj(tokenizer, vocab_size)
    if not isinstance(backend, GrammarBackend):
        raise TypeError(f"grammar backend '{entry.name}' ({entry.origin}): its factory returned "
                        f"{type(backend).__name__}, not an engine.interfaces.GrammarBackend")
    return GrammarCompiler(entry.name, backend)
