"""The storage tier: pages written in the background as nodes reach the host tier, and read
ahead (prefetched) for a waiting request whose prefix continues in storage.

Writes never block a step: the engine thread copies a page's K/V out and queues it; a writer
thread encodes (checksum) and stores it (a full queue drops the page, counted). Reads: the
first match of a request whose next page is stored starts a prefetch on a reader thread,
which reads and checks the pages in order and stops at the first missing or refused one
(refused pages are logged, never loaded). ``--hicache-storage-prefetch-policy``: best_effort
admits the request with what has been read so far, wait_complete holds it (not the others)
until its prefetch is done, timeout holds it at most SGLang's 1 s + 0.25 s per 1024 tokens.

With ranks (``--tp-size``/``--pp-size``) every rank stores its own shard of a page, rank r > 0
under the page's key + ``-r{r}`` (hicache/shards.py); rank 0's reader reads and checks every
rank's shard of a page before the page counts as read, so a page loads on all ranks or none.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.hicache.copier import journal_storage, read_sources
from engine.hicache.pages import PageError, PageKV, decode, encode, identity_seed, page_keys
from engine.hicache.settings import prefetch_timeout

logger = logging.getLogger("engine")
WRITE_QUEUE = 256  # pages waiting to be written
MAX_JOBS = 64  # prefetches kept (a request's until it is admitted)
MAX_KEY_MEMOS = 1024


class StorageMatch(NamedTuple):
    pages: list  # (position of the page's first token, PageKV, key, tokens), consecutive
    length: int  # tokens they add past the tree's match
    wait: bool  # the prefetch policy holds the request back for now


@dataclass
class _Prefetch:
    first: int  # page index of keys[0]
    keys: list
    tokens: list  # the tokens of those pages
    started: float = field(default_factory=time.monotonic)
    pages: list = field(default_factory=list)  # PageKV, read and checked, in order
    done: bool = False
    cancelled: bool = False


class Shard(NamedTuple):
    """Another rank's shard of every page: its key suffix, identity and one page's shapes."""
    suffix: str
    identity: dict
    like: PageKV


class StorageTier:
    def __init__(self, backend, identity: dict, page_tokens: int, like: PageKV, policy: str,
                 stats, shards: list[Shard] | None = None, remote_flush=None):
        self.backend, self.identity, self.page_tokens = backend, identity, page_tokens
        self.like, self.policy, self.stats = like, policy, stats
        self.shards = shards or []  # the other ranks' (ranks/executor.py: hicache_storage)
        self.remote_flush = remote_flush  # their queued pages written, when they have some
        self.seed = identity_seed(identity)
        self._keys: OrderedDict = OrderedDict()  # rid -> (tokens, keys): the hash chains
        self._jobs: OrderedDict = OrderedDict()  # rid -> _Prefetch
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="hicache-read")
        self._queue: queue.Queue = queue.Queue(WRITE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="hicache-write",
                                        daemon=True)
        self._writer.start()

    # -- keys ---------------------------------------------------------------------------------
    def keys(self, rid: str | None, tokens, pages: int) -> list[str]:
        """The first ``pages`` page keys of ``tokens`` (memoized per request: a waiting
        request is matched every step)."""
        memo = self._keys.get(rid) if rid is not None else None
        n = pages * self.page_tokens
        if memo is not None and len(memo[1]) >= pages and memo[0][:n] == tuple(tokens[:n]):
            return memo[1][:pages]
        keys = page_keys(tokens, self.page_tokens, self.seed, pages)
        if rid is not None:
            self._keys[rid] = (tuple(tokens[:n]), keys)
            self._keys.move_to_end(rid)
            while len(self._keys) > MAX_KEY_MEMOS:
                self._keys.popitem(last=False)
        return keys

    # -- writes ---------------------------------------------------------------------------------
    def write_node(self, tree, node) -> None:
        """Queue the storage pages that end inside ``node`` (just copied to the host tier)."""
        path = tree.path(node)
        tokens = [t for n in path for t in n.key]
        end, p = len(tokens), self.page_tokens
        start = end - len(node.key)
        first, last = start // p, end // p  # pages [first, last) end in (start, end]
        if first >= last:
            return
        keys = page_keys(tokens, p, self.seed, last)
        for i in range(first, last):
            page_tokens = tokens[i * p:(i + 1) * p]
            sources = tree.kv_sources(path, i * p, (i + 1) * p)
            self.put(keys[i], page_tokens, PageKV(*read_sources(tree.pool, tree.host, sources)))
            if self.shards:  # the other ranks store their shards of the same positions
                journal_storage(tree.pool, tree.host, "store", (keys[i], page_tokens), sources)

    def put(self, key: str, tokens, page: PageKV) -> None:
        """Queue a page for the writer (a full queue drops it, counted)."""
        try:
            self._queue.put_nowait((key, tokens, page))
        except queue.Full:
            self.stats.storage_dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, tokens, page = item
                if not self.backend.exists(key):
                    data = encode(key, self.identity, tokens, page)
                    self.backend.set(key, data)
                    self.stats.moved("host->storage", len(data))
            except Exception as e:  # a failing store must not stop the engine
                logger.warning(f"HiCache storage: writing a page failed: {e}")
            finally:
                self._queue.task_done()

    def flush_writes(self) -> None:
        """Wait until every queued page is written (tests, shutdown), the other ranks' too."""
        self._queue.join()
        if self.remote_flush is not None:
            self.remote_flush()

    def close(self) -> None:
        self.flush_writes()
        self._queue.put(None)
        self._writer.join(timeout=10)
        self._reader.shutdown(wait=True, cancel_futures=True)

    # -- reads --------------------------------------------------------------------------------
    def match(self, rid: str, tokens, start: int) -> StorageMatch:
        """Stored pages that continue a prefix of ``tokens`` matched up to ``start`` (the
        tree's match) and have been read; starts their prefetch on the first call."""
        p = self.page_tokens
        first, last = start // p, len(tokens) // p
        none = StorageMatch([], 0, False)
        if first >= last:
            return none
        job = self._jobs.get(rid)
        if job is None or first < job.first or first >= job.first + len(job.keys):
            keys = self.keys(rid, tokens, last)
            if not self.backend.exists(keys[first]):
                return none
            job = _Prefetch(first, keys[first:], list(tokens[first * p: last * p]))
            self._jobs[rid] = job
            while len(self._jobs) > MAX_JOBS:
                self._jobs.popitem(last=False)[1].cancelled = True
            self._reader.submit(self._prefetch, job)
        at = first - job.first  # the job's page index of ``first``
        ready = job.pages[at:]
        pages = [((first + i) * p, page, job.keys[at + i],
                  job.tokens[(at + i) * p:(at + i + 1) * p]) for i, page in enumerate(ready)]
        length = (first + len(ready)) * p - start if ready else 0
        wait = not job.done and (
            self.policy == "wait_complete" or (self.policy == "timeout" and time.monotonic()
                                               - job.started < prefetch_timeout(len(job.tokens))))
        return StorageMatch(pages, length, wait)

    def admitted(self, rid: str) -> None:
        """``rid`` was admitted: its prefetch (done or not) is no longer needed."""
        job = self._jobs.pop(rid, None)
        if job is not None:
            job.cancelled = True

    def _prefetch(self, job: _Prefetch) -> None:
        p = self.page_tokens
        try:
            for i, key in enumerate(job.keys):
                if job.cancelled:
                    return
                tokens = job.tokens[i * p:(i + 1) * p]
                page = self._read(key, self.identity, tokens, self.like)
                # a page loads on every rank or none: each other rank's shard checked here
                if page is None or any(self._read(key + s.suffix, s.identity, tokens, s.like)
                                       is None for s in self.shards):
                    return
                job.pages.append(page)
        except Exception as e:
            logger.warning(f"HiCache storage: reading a page failed: {e}")
        finally:
            job.done = True

    def _read(self, key: str, identity: dict, tokens, like: PageKV) -> PageKV | None:
        """The page stored under ``key``, checked; None when it is missing or refused (logged,
        counted)."""
        data = self.backend.get(key)
        if data is None:
            return None
        try:
            return decode(data, key, identity, tokens, like)
        except PageError as e:
            self.stats.storage_rejected += 1
            logger.warning(f"HiCache storage: page {key[:16]}…{key[64:]} ignored, not loaded: {e}")
            return None
