"""Copies between the device pool and the host tier that run beside the step, never in it.

A copy is started on the scheduler's thread and returns a ``Copy``; the tree (``tree.py``)
polls its copies once per step (``done()`` never blocks) and finishes those that completed.

- ``ThreadCopier`` (the device pool in host memory: CPUs): one background thread runs the
  copies in the order they were started (a load of host slots runs after their write).
- ``CudaCopier``: one dedicated copy stream (``torch.cuda.Stream``) that waits for the work
  already queued on the scheduler's stream, non-blocking copies between pinned host staging
  buffers and the device, and a ``torch.cuda.Event`` recorded after each copy: ``done()`` is
  ``event.query()``, and ``order_after()`` makes the current stream wait on the event
  (``Stream.wait_event``) before a forward reads the copied slots.

Device -> host copies (write-through, write-back on eviction) copy a snapshot: the slots are
gathered on the scheduler's stream when the copy starts (on a GPU a device-side gather, queued,
not waited for), so their device slots may be freed and reused at once. Host -> device loads
write into slots the request alone holds until its copy is done.

``delay_steps`` (tests): a copy counts as done only ``delay_steps`` polls after it started.

With ``--tp-size``/``--pp-size`` every rank holds its own shard of the pool and its own host
tier of the same slots: rank 0's copies are journaled in its pool's ``copy_journal`` and sent
with the next batch, and each rank makes them in its own tiers before that forward
(``replay_copies``), in order. A backup's slots hold the K/V of forwards already run, and only
a forward writes the pool, so making it just before the next one copies the same data.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Copy:
    """One copy in flight: ``done()`` (non-blocking), ``wait()`` (blocking: idle or shutdown
    only), ``order_after()`` (the current stream waits for it), ``finish()`` once done."""

    def __init__(self, copier, nbytes: int, future: Future | None = None, event=None,
                 finish=None, keep=()):
        self.copier, self.nbytes = copier, nbytes
        self.future, self.event, self._finish, self._keep = future, event, finish, keep
        self.ready_at = copier.polls + copier.delay_steps

    def copied(self) -> bool:
        """The bytes have arrived (the test delay aside)."""
        if self.future is not None:
            return self.future.done()
        return self.event.query()

    def done(self) -> bool:
        return self.copier.polls >= self.ready_at and self.copied()

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
        else:
            self.event.synchronize()

    def order_after(self) -> None:
        """Whatever the current stream runs next sees the copied data (CPU: waits for it)."""
        if self.event is not None:
            torch.cuda.current_stream(self.copier.device).wait_event(self.event)
        else:
            self.future.result()

    def finish(self) -> None:
        """Once done: raise a copy's error, run its host-side completion, drop its buffers."""
        if self.future is not None:
            self.future.result()
        if self._finish is not None:
            self._finish()
        self._finish, self._keep = None, ()


class _Copier:
    """What both copiers count: the tree's polls (``tick``, once per step) and the test
    delay (``delay_steps``: a copy is done only that many polls after it started)."""

    def __init__(self):
        self.polls = 0
        self.delay_steps = 0

    def tick(self) -> None:
        self.polls += 1


def _journal(pool, host, kind: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Record a copy for the other ranks (their pools and host tiers are shards of the same
    slots); nothing without them."""
    if pool.copy_journal is not None:
        journal_storage(pool, host, kind, src.to("cpu", torch.int64), dst.to("cpu", torch.int64))


def journal_storage(pool, host, kind: str, what, where) -> None:
    """Record a step for the other ranks: a copy (``_journal``) or a storage-tier step
    (hicache/shards.py): ``store`` (``what``:
    the page's key and tokens, ``where``: where its K/V are, ``read_sources``'s segments),
    ``storage_host`` / ``storage_load`` (``what``: key, tokens and the first position used,
    ``where``: the host / device slots it goes to); nothing without them."""
    if pool.copy_journal is not None:
        pool.copy_journal.append((kind, what, where, host.size))


def replay_copies(pool, host, copies: list, storage=None):
    """A worker rank: rank 0's journaled copies made between ``pool`` and ``host`` (created
    here on the first, the size rank 0's host tier has: returned), in order; the storage
    steps with this rank's ``storage`` (hicache/shards.py's ``RankPages``)."""
    from engine.hicache.host_pool import HostKVPool

    for kind, src, dst, size in copies:
        if host is None:
            host = HostKVPool(pool, size)
        if kind == "backup":  # device src -> host dst
            _write_host(host, _snapshot(pool, src.to(pool.k_buffer[0].device)), dst)
        elif kind == "load":  # host src -> device dst
            _load_now(host, pool, src, dst)
        elif storage is None:
            raise RuntimeError(f"rank 0 sent a HiCache storage step ({kind}) to a rank without "
                               f"a storage tier")
        elif kind == "store":  # this rank's shard of a page, queued for storage
            storage.store(pool, host, src, dst)
        elif kind == "storage_host":  # this rank's shard of a stored page into host slots dst
            storage.load(host, src, dst, to_host=True)
        else:  # storage_load: this rank's shard of a stored page into the device slots dst
            storage.load(pool, src, dst)
    return host


def read_sources(pool, host, sources: list) -> tuple[list, list]:
    """Per layer K and V (host tensors) of ``sources``: ("host" | "device", slots) segments,
    in order."""
    ks, vs = [], []
    for where, slots in sources:
        if where == "host":
            k, v = host.read(slots)
        else:
            idx = slots.to(pool.k_buffer[0].device, torch.int64)
            k = [buf.index_select(0, idx).cpu() for buf in pool.k_buffer]
            v = [buf.index_select(0, idx).cpu() for buf in pool.v_buffer]
        ks.append(k)
        vs.append(v)
    return [torch.cat(layer) for layer in zip(*ks)], [torch.cat(layer) for layer in zip(*vs)]


def page_spans(pages: list, start: int):
    """(page, key, tokens, first position used, tokens used) of storage ``pages`` ((position,
    PageKV, key, tokens), consecutive) from position ``start`` on: the first page may begin
    before it (the tree already holds its head)."""
    for pos, page, key, tokens in pages:
        off = max(start - pos, 0)
        yield page, key, tokens, off, len(page.k[0]) - off


def write_page_host(host, page, off: int, rows: torch.Tensor) -> int:
    """A storage page's K/V from its position ``off`` on into the host slots ``rows``; the
    bytes moved."""
    return _put_page(host.k, host.v, page, off, rows)


def load_page(pool, page, off: int, rows: torch.Tensor) -> int:
    """A storage page's K/V from its position ``off`` on into the device slots ``rows``
    (int64, on the pool's device); the bytes moved."""
    return _put_page(pool.k_buffer, pool.v_buffer, page, off, rows)


def _put_page(ks: list, vs: list, page, off: int, rows: torch.Tensor) -> int:
    moved = 0
    for bufs, tensors in ((ks, page.k), (vs, page.v)):
        for buf, t in zip(bufs, tensors):
            buf.index_copy_(0, rows, t[off:].to(buf.device, buf.dtype))
            moved += t[off:].numel() * t.element_size()
    return moved


def _load_now(host, pool, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
    """Host slots -> device slots, now (int64 indices)."""
    for src, dst in ((host.k, pool.k_buffer), (host.v, pool.v_buffer)):
        for s, t in zip(src, dst):
            t.index_copy_(0, device_slots.to(t.device), s.index_select(0, host_slots).to(t.device))


def _write_host(host, snap: list[list[torch.Tensor]], host_slots: torch.Tensor) -> None:
    """A snapshot's [K, V] per layer into the host slots (int64 indices)."""
    for src, dst in zip(snap, (host.k, host.v)):
        for s, t in zip(src, dst):
            t.index_copy_(0, host_slots, s.to(t.device))


def _snapshot(pool, device_slots: torch.Tensor) -> list[list[torch.Tensor]]:
    """[K, V] per layer of the pool's ``device_slots``, gathered now on the current stream (a
    backup copies this, so the slots may be freed and reused at once)."""
    return [[b.index_select(0, device_slots) for b in bufs]
            for bufs in (pool.k_buffer, pool.v_buffer)]


class ThreadCopier(_Copier):
    kind = "background thread"
    # a load is waited for at admission: the step's own work already takes the CPU's cores,
    # so a copy beside it overlaps little, and a request admitted a step later costs a step
    # (measured: benchmarks/hicache.py 1.95x vs 1.64x of the radix cache alone)
    waits_for_loads = True

    def __init__(self, inline: bool = True):
        super().__init__()
        # inline: each copy runs at once on the caller's thread (a CPU's step already keeps
        # its cores busy: a copy thread beside it only competes with it; measured, the thread
        # cost benchmarks/hicache.py 1.95x -> 1.6x of the radix cache alone); False: on the
        # background thread, polled (what the tests slow down with delay_steps)
        self.inline = inline
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hicache-copy")

    def _submit(self, run) -> Future:
        if not self.inline or self.delay_steps:
            return self._pool.submit(run)
        done: Future = Future()
        run()
        done.set_result(None)
        return done

    def load(self, host, pool, host_slots, device_slots) -> Copy:
        """Host slots -> device slots."""
        h, d = host_slots.to(torch.int64), device_slots.to(torch.int64)
        _journal(pool, host, "load", h, d)

        return Copy(self, len(h) * host.bytes_per_token(),
                    self._submit(lambda: _load_now(host, pool, h, d)))

    def backup(self, host, pool, device_slots, host_slots) -> Copy:
        """Device slots -> host slots, from a snapshot taken now."""
        h = host_slots.to(torch.int64)
        _journal(pool, host, "backup", device_slots, h)
        snap = _snapshot(pool, device_slots.to(torch.int64))
        return Copy(self, len(h) * host.bytes_per_token(),
                    self._submit(lambda: _write_host(host, snap, h)))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaCopier(_Copier):
    kind = "CUDA copy stream"
    waits_for_loads = False  # the copy stream runs beside the batch: the request waits

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def _start(self, work) -> torch.cuda.Event:
        """``work()`` on the copy stream after what the current stream has queued; the event
        recorded after it."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            work()
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def load(self, host, pool, host_slots, device_slots) -> Copy:
        """Host slots gathered into pinned staging (host memcpy), then copied to the device
        slots on the copy stream (non-blocking)."""
        h = host_slots.to(torch.int64)
        _journal(pool, host, "load", h, device_slots)
        staged = [[torch.index_select(s, 0, h, out=torch.empty((len(h), *s.shape[1:]),
                                                               dtype=s.dtype, pin_memory=True))
                   for s in src] for src in (host.k, host.v)]
        kept = []

        def work():
            d = device_slots.to(self.device, torch.int64, non_blocking=True)
            kept.append(d)
            for src, dst in zip(staged, (pool.k_buffer, pool.v_buffer)):
                for s, t in zip(src, dst):
                    g = s.to(self.device, non_blocking=True)
                    t.index_copy_(0, d, g)
                    kept.append(g)

        event = self._start(work)
        return Copy(self, len(h) * host.bytes_per_token(), event=event, keep=(staged, kept))

    def backup(self, host, pool, device_slots, host_slots) -> Copy:
        """The slots gathered on the current stream (the snapshot), copied into pinned staging
        on the copy stream; scattered into the host pool when done."""
        h = host_slots.to(torch.int64)
        _journal(pool, host, "backup", device_slots, h)
        snap = _snapshot(pool, device_slots.to(self.device, torch.int64))
        staged = [[torch.empty(s.shape, dtype=s.dtype, pin_memory=True) for s in src]
                  for src in snap]

        def work():
            for src, dst in zip(snap, staged):
                for s, t in zip(src, dst):
                    t.copy_(s, non_blocking=True)

        event = self._start(work)
        return Copy(self, len(h) * host.bytes_per_token(), event=event,
                    finish=lambda: _write_host(host, staged, h), keep=(snap, staged))

    def close(self) -> None:
        self.stream.synchronize()


def make_copier(pool):
    """The copy stream when the device pool is on a CUDA device, else the background thread."""
    device = pool.k_buffer[0].device
    if device.type == "cuda":
        return CudaCopier(device)
    return ThreadCopier()
