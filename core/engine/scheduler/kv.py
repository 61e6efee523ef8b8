"""The one owner of every request's KV bookkeeping (nano-vllm's block manager, SGLang's names).

A request's KV state is five fields on ``Req`` (``row``, ``kv_len``, ``alloc_len``,
``cached_len``, ``last_node``); only this class writes them, through these operations:

- ``match(req)``: the longest cached prefix of its sequence (changes no request); with HiCache
  (engine/hicache) it may continue in the host tier and in storage (``Prefix.loads``).
- ``start_load(req, prefix)``: HiCache: the prefix's host-tier part gets device slots (in the
  tree, locked for ``req``) and its copy starts beside the step; ``req`` waits (its match
  stops before the nodes in flight) until ``poll()``, once per step, sees the copy done.
- ``admit(req, prefix, n)``: a request row holding the prefix (locked in the radix cache;
  stored pages loaded into the pool first) plus slots for ``n`` more tokens; all or nothing.
- ``grow(req, n)``: slots for a prompt chunk; ``grow_decodes(reqs)``: one slot each, in one go.
- ``computed(decodes, chunks)``: the forward wrote their K/V; full prompt pages are cached;
  ``computed_to(req, n)``: a verify step's accepted drafts.
- ``release(req)``: finished or aborted, its computed prefix stays cached (with a cache);
  ``retract(req)``: everything freed, nothing cached (it is recomputed later).

Slots of ``[0, cached_len)`` belong to the radix cache (locked through ``last_node``), slots of
``[cached_len, alloc_len)`` to the request; ``kv_len <= alloc_len`` tokens have K/V.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.hicache.copier import journal_storage, load_page, page_spans
from engine.hicache.report import TierStats
from engine.memory.kv_pool import KVPool
from engine.memory.radix_cache import RadixCache
from engine.scheduler.request import Req


class DecodeSlots(NamedTuple):
    """What ``grow_decodes`` allocated when every decode took a slot: per decode, in order."""
    rows: list[int]
    positions: list[int]  # each request's kv_len: where its token goes
    slots: torch.Tensor  # the slots (the pool's index dtype, on the table's device)


class Loads(NamedTuple):
    """What continues a match past the device pool (HiCache): host-only radix nodes, then
    storage pages read ahead ((position of the page's first token, PageKV), in order)."""
    host_nodes: list
    host_len: int
    storage_pages: list
    storage_len: int

    @property
    def length(self) -> int:
        return self.host_len + self.storage_len


class PendingLoad(NamedTuple):
    """A waiting request's host -> device copy (HiCache): the Copy, the last node it loads
    (locked for the request until it is admitted or gone) and the tokens it brings."""
    copy: object
    node: object
    host_len: int


class Prefix(NamedTuple):
    slots: torch.Tensor  # the cached slots of the request's leading tokens
    node: object  # the radix node ending there (None without a cache)
    loads: Loads | None = None  # HiCache: the match's continuation in the host tier / storage
    wait: bool = False  # a storage prefetch or a host load in flight holds it back for now

    @property
    def loading(self) -> int:
        """Tokens to load back into the pool at admission (they need slots, not compute)."""
        return self.loads.length if self.loads is not None else 0

    @property
    def cached(self) -> int:
        """Prompt tokens the match serves, from every tier."""
        return len(self.slots) + self.loading


class KVManager:
    def __init__(self, pool: KVPool, cache: RadixCache | None, stats: TierStats | None = None):
        self.pool = pool
        self.cache = cache  # a RadixCache, or HiCache's HiRadixCache (engine/hicache/tree.py)
        self.page = pool.page_size
        self.stats = stats or TierStats()  # hits per tier (and HiCache's bytes moved)
        self.tiered = hasattr(cache, "match_tiers")
        self.loads: dict[str, PendingLoad] = {}  # rid -> its host load (HiCache)
        self.staged: dict[str, int] = {}  # rid -> the stored tokens its host load brings
        self._orphans: list[PendingLoad] = []  # loads of requests gone before they landed

    # -- capacity ------------------------------------------------------------------------------
    @property
    def evictable(self) -> int:
        return self.cache.evictable_size if self.cache else 0

    @property
    def used_tokens(self) -> int:
        """Slots held by requests (cached prefixes that could be evicted count as free)."""
        return self.pool.size - self.pool.free_slots - self.evictable

    def available(self, node=None) -> int:
        """Free plus evictable slots, as they would be with ``node`` (a match) locked."""
        if self.cache is None:
            return self.pool.free_slots
        if node is None:
            return self.pool.free_slots + self.cache.evictable_size
        return self.pool.free_slots + self.cache.evictable_size_after_lock(node)

    def ensure_free(self, slots: int) -> bool:
        """Evict cached prefixes until ``slots`` slots are free; False when impossible."""
        short = slots - self.pool.free_slots
        if short > 0 and self.cache:
            self.cache.evict(short)
        return self.pool.free_slots >= slots

    def owned_slots(self, req: Req) -> int:
        """Slots this request holds privately (whole pages)."""
        pages = -(-req.alloc_len // self.page) - req.cached_len // self.page
        return pages * self.page

    def check(self, running: list[Req]) -> None:
        """free + held by running requests + held by the cache = total; rows likewise."""
        pool, cache = self.pool, self.cache
        owned = sum(self.owned_slots(r) for r in running)
        cached = cache.total_size if cache else 0
        assert pool.free_slots + owned + cached == pool.size, (pool.free_slots, owned, cached)
        assert pool.free_reqs + len(running) == pool.max_reqs
        if cache:
            cache.check_integrity()  # HiCache's: also the host tier's free + cached = total

    def decode_slots_needed(self, reqs: list[Req]) -> int:
        """Free slots that ``grow_decodes(reqs)`` takes."""
        return self.page * sum(r.alloc_len == r.kv_len and r.alloc_len % self.page == 0
                               for r in reqs)

    # -- admission -----------------------------------------------------------------------------
    def match(self, req: Req) -> Prefix:
        # a prompt whose logprobs are asked for runs from its first token (scheduler/
        # prompt_logprobs.py): a cached prefix would have no logits
        if self.cache is None or req.scores_prompt:
            return Prefix(torch.empty(0, dtype=torch.int64), None)
        # the last token always goes through the model: its logits are needed to sample
        key = req.seq[: req.seq_len - 1]
        if not self.tiered:
            return Prefix(*self.cache.match_prefix(key))
        slots, node, host_nodes, in_flight = self.cache.match_tiers(key)
        if in_flight:  # a load of this prefix's next nodes has not landed yet
            return Prefix(slots, node, None, True)
        host_len = sum(len(n.key) for n in host_nodes)
        storage = self.cache.storage
        found = (storage.match(req.rid, key, len(slots) + host_len) if storage is not None
                 else None)
        stored, wait = (found.length, found.wait) if found is not None else (0, False)
        if not host_nodes and not stored and not wait:
            return Prefix(slots, node)
        loads = Loads(host_nodes, host_len, found.pages if stored else [], stored)
        return Prefix(slots, node, loads, wait)

    def admit(self, req: Req, prefix: Prefix, n: int) -> bool:
        """Give ``req`` a request row holding ``prefix`` (locked) and slots for ``n`` more
        tokens; False, holding nothing, when no row is free or the slots cannot be freed."""
        row = self.pool.alloc_req()
        if row is None:
            return False
        matched = prefix
        assert prefix.loads is None or not prefix.loads.host_len, "start_load comes first"
        if prefix.loading:
            prefix = self._load(req, prefix)
            if prefix is None:
                self.pool.free_req(row)
                return False
        if self.tiered:
            self.cache.record_hit(prefix.node)
            if self.cache.storage is not None:
                self.cache.storage.admitted(req.rid)
        req.row = row
        k = len(prefix.slots)
        if k:
            self.pool.write_row(row, 0, prefix.slots)
        req.kv_len = req.alloc_len = req.cached_len = k
        req.last_node = prefix.node
        if prefix.node is not None:
            self.cache.inc_lock(prefix.node)
        pending = self.loads.pop(req.rid, None)
        if pending is not None:  # its load landed; the request's own lock holds the path now
            self.cache.dec_lock(pending.node)
        if not self.grow(req, n):
            self.retract(req)
            return False
        loaded = pending.host_len if pending is not None else 0
        staged = min(self.staged.pop(req.rid, 0), loaded)  # (staged, then evicted: recomputed)
        if req.num_retractions == 0:  # (a retracted request was counted the first time)
            self._count_hits(matched, loaded, staged)
        return True

    def _count_hits(self, prefix: Prefix, loaded: int, staged: int) -> None:
        """``loaded``: the tokens its host load brought, ``staged`` of them from storage."""
        loads = prefix.loads
        self.stats.hit("device", len(prefix.slots) - loaded)
        self.stats.hit("host", loaded - staged)
        self.stats.hit("storage", staged + (loads.storage_len if loads else 0))

    def stage_storage(self, req: Req, prefix: Prefix) -> Prefix:
        """HiCache: the match's storage pages (read ahead) into the host tier, as a host-only
        node continuing the match, so that they load back as host nodes do (on a GPU on the
        copy stream, the request waiting, the batch running); the match again. Where the host
        tier cannot take them the match is returned as it was (its pages then go straight to
        the device at admission)."""
        loads = prefix.loads
        start = len(prefix.slots) + loads.host_len
        parent = loads.host_nodes[-1] if loads.host_nodes else prefix.node
        key = req.seq[start: start + loads.storage_len]
        if self.cache.stage(parent, key, loads.storage_pages, start, loads.host_nodes) is None:
            return prefix
        self.staged[req.rid] = self.staged.get(req.rid, 0) + loads.storage_len
        return self.match(req)

    def _load(self, req: Req, prefix: Prefix) -> Prefix | None:
        """HiCache: the prefix's storage pages (read ahead into host memory) copied into the
        pool (slots made free by evicting, the device part locked meanwhile); the prefix as the
        pool now holds it, or None (nothing loaded) when the slots cannot be freed."""
        cache, loads = self.cache, prefix.loads
        cache.inc_lock(prefix.node)
        try:
            if not self.ensure_free(loads.storage_len):
                return None
            stored = self._alloc(loads.storage_len)
            held = prefix.slots
            self._load_pages(loads.storage_pages, len(held), stored)
            node, held = cache.insert(req.seq[: len(held) + len(stored)],
                                      torch.cat([held, stored]))[1:]
            return Prefix(held, node)
        finally:
            cache.dec_lock(prefix.node)

    def _alloc(self, tokens: int) -> torch.Tensor:
        slots = self.pool.alloc_pages(tokens // self.page)
        assert slots is not None, "no room made"
        if self.page > 1:
            slots = (slots[:, None] * self.page + torch.arange(self.page)).reshape(-1)
        return slots

    # -- loads beside the step (HiCache) ---------------------------------------------------------
    def start_load(self, req: Req, prefix: Prefix) -> bool:
        """Start copying ``prefix``'s host-tier nodes into free device slots (evicting for
        them); ``req`` then waits for the copy. False, starting nothing, when the slots cannot
        be freed. A host copy still being written is waited for (True, nothing started)."""
        cache, nodes = self.cache, prefix.loads.host_nodes
        if any(n.writing is not None for n in nodes):
            return True
        cache.inc_lock(prefix.node)  # the device part, and the host nodes, kept meanwhile
        cache.pin(nodes)
        try:
            if not self.ensure_free(prefix.loads.host_len):
                return False
            cache.start_load(nodes, self._alloc(prefix.loads.host_len))
            cache.inc_lock(nodes[-1])  # the request's until it is admitted or gone
            self.loads[req.rid] = PendingLoad(nodes[-1].loading, nodes[-1],
                                              prefix.loads.host_len)
            return True
        finally:
            cache.unpin()
            cache.dec_lock(prefix.node)

    def land_now(self, req: Req) -> bool:
        """Where the copier does not overlap loads with the step (a CPU's thread: see
        hicache/copier.py), wait for ``req``'s load and finish it now, so that it is admitted
        in this step; False (the request waits while the batch runs) elsewhere."""
        copier = self.cache.copier
        if not getattr(copier, "waits_for_loads", False) or copier.delay_steps:
            return False
        self.cache.drain()
        pending = self.loads.get(req.rid)
        # None: its host copy was still being written, nothing started: it waits a step
        return pending is not None and pending.node.loading is None

    def poll(self) -> None:
        """Once per step: finish the copies that completed; unlock loads nobody waits for."""
        if not self.tiered:
            return
        self.cache.poll()
        if self._orphans:
            for p in [p for p in self._orphans if p.node.loading is None]:
                self.cache.dec_lock(p.node)
                self._orphans.remove(p)

    def forget(self, req: Req) -> None:
        """A waiting ``req`` is gone (aborted): its load's slots go back to the cache, unlocked
        (evictable) once the copy has landed."""
        self.staged.pop(req.rid, None)
        pending = self.loads.pop(req.rid, None)
        if pending is None:
            return
        if pending.node.loading is None:
            self.cache.dec_lock(pending.node)
        else:
            self._orphans.append(pending)

    def drop_loads(self) -> None:
        """The running batch is short of slots (rare): the waiting requests' loads give their
        locks up, landed first (a wait), their slots evictable; they load again if evicted."""
        pending = [*self.loads.values(), *self._orphans]
        if not pending:
            return
        self.cache.drain()
        for p in pending:
            self.cache.dec_lock(p.node)
        self.loads.clear()
        self._orphans.clear()

    def idle(self) -> None:
        """Nothing ran this step: wait for the oldest copy in flight, if any (no spinning)."""
        if self.tiered:
            self.cache.wait_first()

    def _load_pages(self, pages: list, start: int, slots: torch.Tensor) -> None:
        """Storage pages' K/V into the pool's ``slots``, from position ``start`` on (the first
        page may begin before it: the tree already held its head); with ranks, each loads its
        own shard of the same pages into the same slots before the next forward."""
        pool, done, moved = self.pool, 0, 0
        idx = slots.to(pool.k_buffer[0].device, torch.int64)
        for page, key, tokens, off, used in page_spans(pages, start):
            rows = idx[done: done + used]
            moved += load_page(pool, page, off, rows)
            journal_storage(pool, self.cache.host, "storage_load", (key, tokens, off),
                            rows.to("cpu"))
            done += used
        self.stats.moved("storage->device", moved)

    # -- growth --------------------------------------------------------------------------------
    def grow(self, req: Req, n: int) -> bool:
        """Allocate slots for ``n`` more tokens of ``req`` (evicting if needed)."""
        need = n - (req.alloc_len - req.kv_len)
        if need <= 0:
            return True
        pages = self.pool.pages_needed(req.alloc_len, need)
        if not self.ensure_free(pages * self.page):
            return False
        slots = self.pool.extend_slots(req.row, req.alloc_len, need)
        assert slots is not None
        req.alloc_len += need
        return True

    def grow_decodes(self, reqs: list[Req]) -> DecodeSlots | None:
        """One more slot for each of ``reqs`` (each decodes one token), allocated and recorded
        in one go; the caller has made ``decode_slots_needed(reqs)`` free. When every request
        took a new slot (always with pages of one), returns their rows, positions (= their
        ``kv_len``) and slots, in the order of ``reqs``: the decode batch's own columns."""
        rows, positions = [], []  # one pass over the requests, counting the slot in
        for r in reqs:
            a = r.alloc_len
            if a == r.kv_len:
                r.alloc_len = a + 1
                rows.append(r.row)
                positions.append(a)
        if not rows:
            return None
        table, page = self.pool.host_table, self.page  # (the host's copy: no device read)
        assert max(positions) < table.shape[1], "sequence longer than max_context_len"
        if page == 1:  # every decode takes a new page of one slot
            slots = self.pool.alloc_pages(len(rows))
            assert slots is not None, "no room made for the decodes"
        else:  # a new page where the last one is full, else the last page's next slot
            full = [p % page == 0 for p in positions]  # rows whose last page is full
            pages = self.pool.alloc_pages(sum(full))
            assert pages is not None, "no room made for the decodes"
            pages = pages.to(table.device, table.dtype)
            pos = torch.tensor(positions, device=table.device)
            slots = table[torch.tensor(rows, device=table.device), (pos - 1).clamp(min=0)] + 1
            slots[torch.tensor(full, device=table.device)] = pages * page
        self.pool.write_slots(rows, positions, slots)
        return DecodeSlots(rows, positions, slots) if len(rows) == len(reqs) else None

    def computed(self, decodes: list[Req], chunks: list[tuple[Req, int]]) -> None:
        """The forward wrote K/V for one token of each decode and ``n`` of each prompt chunk;
        the prompt's full pages go to the radix cache for requests admitted later."""
        for r in decodes:
            r.kv_len += 1
        for r, n in chunks:
            r.kv_len += n
            self._cache_prefix(r)

    def computed_to(self, req: Req, kv_len: int) -> None:
        """A verify step (engine/speculative): ``req``'s K/V is right up to ``kv_len`` (its
        accepted drafts); slots past it, of rejected drafts, stay its own to overwrite."""
        assert req.kv_len <= kv_len <= req.alloc_len, (req.kv_len, kv_len, req.alloc_len)
        req.kv_len = kv_len

    # -- release -------------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Free what a finished or aborted ``req`` holds; its computed prefix stays cached."""
        self._free(req, keep_in_cache=self.cache is not None)

    def retract(self, req: Req) -> None:
        """Free everything ``req`` holds, caching nothing."""
        self._free(req, keep_in_cache=False)

    def _free(self, req: Req, keep_in_cache: bool) -> None:
        if req.row is None:
            return
        if keep_in_cache:
            self._cache_prefix(req)
        self._free_range(req, req.cached_len, req.alloc_len)
        if req.last_node is not None:
            self.cache.dec_lock(req.last_node)
        self.pool.free_req(req.row)
        req.row, req.last_node = None, None
        req.kv_len = req.alloc_len = req.cached_len = 0

    def _cache_prefix(self, req: Req) -> None:
        """Hand the request's computed full pages to the radix cache; where the tree already
        held some of them, free ours and point the request's row at the tree's."""
        if self.cache is None:
            return
        n = req.kv_len - req.kv_len % self.page
        if n <= req.cached_len:
            return
        row = self.pool.host_table[req.row]
        dup, node, slots = self.cache.insert(req.seq[:n], row[:n])  # (the tree clones it)
        if dup > req.cached_len:
            self._free_range(req, req.cached_len, dup)
            self.pool.write_row(req.row, req.cached_len, slots[req.cached_len:dup])
        self.cache.inc_lock(node)  # lock the new end before unlocking the old (shared) path
        if req.last_node is not None:
            self.cache.dec_lock(req.last_node)
        req.last_node, req.cached_len = node, n

    def _free_range(self, req: Req, start: int, end: int) -> None:
        if end > start:
            self.pool.free_slots_of(self.pool.host_table[req.row, start:end])
