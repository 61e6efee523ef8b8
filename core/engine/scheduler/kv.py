"""Who owns which KV slots: a request's private slots versus the radix cache's shared ones."""

from __future__ import annotations

import torch

from engine.memory.kv_pool import KVPool
from engine.memory.radix_cache import RadixCache
from engine.scheduler.request import Req


class KVManager:
    def __init__(self, pool: KVPool, cache: RadixCache | None):
        self.pool = pool
        self.cache = cache
        self.page = pool.page_size

    # -- capacity ------------------------------------------------------------------------------
    @property
    def evictable(self) -> int:
        return self.cache.evictable_size if self.cache else 0

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

    # -- admission -----------------------------------------------------------------------------
    def match(self, req: Req):
        if self.cache is None:
            return torch.empty(0, dtype=torch.int64), None
        # the last token always goes through the model: its logits are needed to sample
        return self.cache.match_prefix(req.seq[: req.seq_len - 1])

    def attach(self, req: Req, prefix_slots: torch.Tensor, node) -> bool:
        """Give ``req`` a request row holding the cached prefix; False when no row is free."""
        row = self.pool.alloc_req()
        if row is None:
            return False
        req.row = row
        n = len(prefix_slots)
        if n:
            self.pool.req_to_token[row, :n] = prefix_slots.to(self.pool.req_to_token.device)
        req.kv_len = req.alloc_len = req.cached_len = n
        req.last_node = node
        if node is not None:
            self.cache.inc_lock(node)
        return True

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

    def decode_slots_needed(self, reqs: list[Req]) -> int:
        """Free slots that ``grow_decodes(reqs)`` takes."""
        return self.page * sum(r.alloc_len == r.kv_len and r.alloc_len % self.page == 0
                               for r in reqs)

    def grow_decodes(self, reqs: list[Req]) -> None:
        """One more slot for each of ``reqs`` (each decodes one token), allocated and recorded
        in one go; the caller has made ``decode_slots_needed(reqs)`` free."""
        reqs = [r for r in reqs if r.alloc_len == r.kv_len]
        if not reqs:
            return
        table, page = self.pool.req_to_token, self.page
        positions = [r.alloc_len for r in reqs]
        assert max(positions) < table.shape[1], "sequence longer than max_context_len"
        rows = torch.tensor([r.row for r in reqs], device=table.device)
        pos = torch.tensor(positions, device=table.device)
        full = [p % page == 0 for p in positions]  # rows whose last page is full
        pages = self.pool.alloc_pages(sum(full))
        assert pages is not None, "no room made for the decodes"
        pages = pages.to(table.device)
        if page == 1:
            slots = pages
        else:  # a new page where the last one is full, else the last page's next slot
            slots = table[rows, (pos - 1).clamp(min=0)] + 1
            slots[torch.tensor(full, device=table.device)] = pages * page
        table[rows, pos] = slots.to(table.dtype)
        for r in reqs:
            r.alloc_len += 1

    def slots_needed(self, req: Req, n: int) -> int:
        need = n - (req.alloc_len - req.kv_len)
        return self.pool.pages_needed(req.alloc_len, need) * self.page if need > 0 else 0

    # -- release -------------------------------------------------------------------------------
    def _free_range(self, req: Req, start: int, end: int) -> None:
        if end > start:
            self.pool.free_slots_of(self.pool.req_to_token[req.row, start:end])

    def cache_prefix(self, req: Req) -> None:
        """Hand the request's computed prefix to the radix cache so others can share it."""
        if self.cache is None:
            return
        n = req.kv_len - req.kv_len % self.page
        if n <= req.cached_len:
            return
        row = self.pool.req_to_token[req.row]
        already = self.cache.insert(req.seq[:n], row[:n].cpu())
        # the tree already had [cached_len, already) under other slots: ours are duplicates
        self._free_range(req, req.cached_len, already)
        slots, node = self.cache.match_prefix(req.seq[:n])
        assert len(slots) == n
        row[:n] = slots.to(row.device)
        self.cache.inc_lock(node)
        if req.last_node is not None:
            self.cache.dec_lock(req.last_node)
        req.last_node, req.cached_len = node, n

    def release(self, req: Req, keep_in_cache: bool) -> None:
        """Free everything ``req`` holds; with ``keep_in_cache`` its prefix stays cached."""
        if req.row is None:
            return
        if keep_in_cache:
            self.cache_prefix(req)
        self._free_range(req, req.cached_len, req.alloc_len)
        if req.last_node is not None:
            self.cache.dec_lock(req.last_node)
        self.pool.free_req(req.row)
        req.row, req.last_node = None, None
        req.kv_len = req.alloc_len = req.cached_len = 0
