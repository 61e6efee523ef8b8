"""The KV-cache pool: per-layer K and V slot tensors, a page allocator and the request table.

A slot holds one token's K and V for one layer. Slots are handed out in pages of ``page_size``
slots (page p owns slots ``p*page_size .. p*page_size+page_size-1``); page 0 is never handed out,
so slot 0 is a scratch slot that padded metadata can point at harmlessly. Likewise request row
``scratch_row`` (one past the last real row) is never handed out and maps every position to
slot 0: the padding rows of a CUDA-graph decode batch use it.

K and V go in and out through the pool's ``KVDtype`` (``store`` / ``load``, with the layer's
scale), so the pool knows no storage format; the allocator tracks each page's state, so that
freeing a page twice (or page 0, or a page that does not exist) fails at the call.

An MLA model's pool (``latent=True``) holds one row per token and layer instead (the compressed
latent and the rope key, ``head_dim`` values, one "head"), in ``k_buffer``; there is no V
buffer (``v_buffer`` is empty) and the rows go in and out through ``set_latent`` /
``get_latent``, with the layer's K scale.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.host import long_tensor, to_device
from engine.memory.kv_dtype import KVDtype


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int,
                 dtype: torch.dtype, device="cpu", page_size: int = 1, max_reqs: int = 256,
                 max_context_len: int = 4096, needs_scale: bool | None = None,
                 kv_dtype: KVDtype | None = None, latent: bool = False):
        """``kv_dtype``: the format (default: plain ``dtype``, scaled with ``needs_scale``);
        its ``storage``, when set, must be ``dtype``. ``latent``: an MLA model's pool, one row
        of ``head_dim`` values per token and layer (``num_kv_heads`` must be 1), no V."""
        assert not latent or num_kv_heads == 1, "an MLA pool holds one latent row per token"
        assert num_tokens >= page_size > 0
        if kv_dtype is None:
            kv_dtype = KVDtype(dtype, needs_scale=bool(needs_scale))
        if needs_scale is not None and needs_scale != kv_dtype.needs_scale:
            raise ValueError(f"needs_scale={needs_scale} contradicts the KV dtype {kv_dtype}; "
                             f"pass one of them")
        if kv_dtype.storage is not None and kv_dtype.storage != dtype:
            raise ValueError(f"the KV dtype stores {kv_dtype.storage} but the pool was asked "
                             f"for {dtype}")
        self.kv_dtype = kv_dtype
        self.page_size = page_size
        self.num_pages = num_tokens // page_size
        self.size = self.num_pages * page_size  # usable token slots
        self.dtype = dtype
        self.device = device
        self.num_layers = num_layers
        self.latent = latent
        shape = ((self.num_pages + 1) * page_size, num_kv_heads, head_dim)
        # torch.empty: never zero-fill gigabytes at start
        self.k_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [] if latent else [torch.empty(shape, dtype=dtype, device=device)
                                           for _ in range(num_layers)]
        for buf in (*self.k_buffer, *self.v_buffer):
            # padded metadata reads the scratch page; masked keys get probability 0, but
            # 0 * NaN is NaN, so it must hold finite values
            buf[:page_size].zero_()
        # per-layer dequantization scales (stay 1.0 unless a KV dtype that needs them sets them)
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        # a stack of free page ids in a tensor: compact and O(n) per call even for millions of pages
        self._free_stack = torch.arange(self.num_pages, 0, -1, dtype=torch.int64)
        self._top = self.num_pages  # _free_stack[:_top] are free; the top hands out low pages first
        # page id -> 1 free, 0 in use: a count of free pages cannot see a double free while
        # other pages are in use; this can, vectorized (page 0, the scratch page, is never free)
        self._page_state = torch.ones(self.num_pages + 1, dtype=torch.int32)
        self._page_state[0] = 0
        self.max_context_len = max_context_len
        # int32 slots (a pool holds far fewer than 2^31): at 128k context and 4096 requests the
        # table is 2 GiB, not 4; its bytes are in the sizing report (req_to_token_bytes)
        self.req_to_token = torch.zeros((max_reqs + 1, max_context_len), dtype=torch.int32,
                                        device=device)
        self.scratch_row = max_reqs  # stays all zeros: position -> the scratch slot 0
        # what the host reads of the table (slots to cache, free, extend a page) from a copy in
        # host memory that the two writers keep equal, so on a GPU no read waits for the device;
        # on the CPU the table itself
        self.host_table = self.req_to_token if self.req_to_token.device.type == "cpu" else \
            torch.zeros(self.req_to_token.shape, dtype=torch.int32)
        # with workers (tp/pp ranks) holding copies of the table: every write since the last
        # forward, (row, start, slots on the host), which rank 0 sends with the next batch
        self.row_edits: list[tuple[int, int, torch.Tensor]] | None = None
        # HiCache with --tp-size/--pp-size: the copies between this pool and the host tier,
        # (kind, source slots, destination slots, host pool tokens), for the other ranks
        self.copy_journal: list | None = None
        self._free_reqs = list(range(max_reqs - 1, -1, -1))
        self._row_free = [True] * max_reqs
        self.max_reqs = max_reqs

    @property
    def needs_scale(self) -> bool:
        return self.kv_dtype.needs_scale

    @needs_scale.setter
    def needs_scale(self, value: bool) -> None:
        self.kv_dtype = dataclasses.replace(self.kv_dtype, needs_scale=value)

    # -- token slots, in pages --------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self._top * self.page_size

    @property
    def free_page_count(self) -> int:
        return self._top

    def pages_needed(self, seq_len: int, n: int) -> int:
        """New pages a sequence of ``seq_len`` tokens needs to grow by ``n``."""
        p = self.page_size
        return -(-(seq_len + n) // p) - (-(-seq_len // p))

    def can_alloc(self, pages: int) -> bool:
        return pages <= self._top

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        if n > self._top:
            return None
        pages = self._free_stack[self._top - n: self._top].flip(0)
        self._top -= n
        self._page_state[pages] = 0
        return pages

    def free_pages(self, pages) -> None:
        pages = (pages.to("cpu", torch.int64) if isinstance(pages, torch.Tensor) else
                 long_tensor(pages)).reshape(-1)
        n = pages.numel()
        if n == 0:
            return
        lo, hi = pages.min().item(), pages.max().item()
        assert lo >= 1 and hi <= self.num_pages, (
            f"freeing page {lo if lo < 1 else hi}: pages are 1..{self.num_pages} (page 0 is "
            f"the scratch page and never handed out)")
        # +1 per mention: a page in use ends at 1; one already free, or named twice, above it
        state = self._page_state
        state.index_put_((pages,), torch.ones(n, dtype=state.dtype), accumulate=True)
        times = state[pages]
        if (times != 1).any():
            state.index_put_((pages,), torch.full((n,), -1, dtype=state.dtype), accumulate=True)
            twice = pages[times != 1].unique()
            raise AssertionError(f"a page was freed twice: page(s) {twice[:8].tolist()} "
                                 f"{'are' if len(twice) > 1 else 'is'} already free or "
                                 f"named twice in one call")
        self._free_stack[self._top: self._top + n] = pages
        self._top += n

    def extend_slots(self, row: int, seq_len: int, n: int) -> torch.Tensor | None:
        """Give request ``row`` (holding ``seq_len`` tokens) ``n`` more slots, recorded in
        ``req_to_token``; returns them, or None (nothing allocated) when the pool is short."""
        p = self.page_size
        assert seq_len + n <= self.max_context_len, "sequence longer than max_context_len"
        new_pages = self.alloc_pages(self.pages_needed(seq_len, n))
        if new_pages is None:
            return None
        positions = torch.arange(seq_len, seq_len + n)
        if p == 1:
            slots = new_pages
        else:
            first_new_page = -(-seq_len // p)  # pages already held by the sequence
            held = self.host_table[row, : first_new_page * p : p].long() // p
            page_of = torch.cat([held, new_pages])
            slots = page_of[positions // p] * p + positions % p
        self.write_row(row, seq_len, slots)
        return slots

    def write_row(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record ``slots`` as request ``row``'s positions ``start..``."""
        host = slots.to("cpu", torch.int32)
        self.req_to_token[row, start: start + len(slots)] = to_device(host,
                                                                      self.req_to_token.device)
        if self.host_table is not self.req_to_token:
            self.host_table[row, start: start + len(slots)] = host
        if self.row_edits is not None:
            n = len(slots)
            self.row_edits.append((torch.full((n,), row), torch.arange(start, start + n), host))

    def write_slots(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """Record one slot per (row, position). These two are the only writers of the table,
        so a journal (``row_edits``: (rows, positions, slots) on the host) can mirror it on
        other ranks."""
        table = self.req_to_token
        rows_t, positions_t = long_tensor(rows), long_tensor(positions)
        host = slots.to("cpu", torch.int32)
        if self.host_table is table:
            table[rows_t, positions_t] = host
        else:
            self.host_table[rows_t, positions_t] = host
            table[to_device(rows_t, table.device), to_device(positions_t, table.device)] = \
                to_device(host, table.device)
        if self.row_edits is not None:
            self.row_edits.append((rows_t, positions_t, host))

    def slots_to_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """The distinct pages of ``slots`` (which must cover whole pages or a sequence tail)."""
        if self.page_size == 1:
            return slots
        return torch.unique(slots // self.page_size)

    def free_slots_of(self, slots: torch.Tensor) -> None:
        self.free_pages(self.slots_to_pages(slots.cpu()))

    # -- request rows -------------------------------------------------------------------------
    def alloc_req(self) -> int | None:
        if not self._free_reqs:
            return None
        row = self._free_reqs.pop()
        self._row_free[row] = False
        return row

    def free_req(self, row: int) -> None:
        assert 0 <= row < self.max_reqs, (
            f"freeing request row {row}: rows are 0..{self.max_reqs - 1} (row "
            f"{self.scratch_row} is the scratch row and never handed out)")
        assert not self._row_free[row], f"request row {row} was freed twice"
        self._row_free[row] = True
        self._free_reqs.append(row)

    def free_request(self, row: int, length: int) -> None:
        """Free the pages of request ``row``'s first ``length`` slots, then the row."""
        self.free_pages(self.slots_to_pages(self.req_to_token[row, :length]))
        self.free_req(row)

    @property
    def free_reqs(self) -> int:
        return len(self._free_reqs)

    # -- K/V access ----------------------------------------------------------------------------
    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        assert not self.latent, "an MLA pool holds latent rows: set_latent, not set_kv"
        kv = self.kv_dtype
        self.k_buffer[layer_id][loc] = kv.store(k, self.k_scale[layer_id], self.dtype)
        self.v_buffer[layer_id][loc] = kv.store(v, self.v_scale[layer_id], self.dtype)

    def set_latent(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor) -> None:
        """An MLA pool: the rows [n, 1, head_dim] of the tokens at slots ``loc``."""
        assert self.latent, "set_latent is an MLA pool's; this pool holds K and V"
        self.k_buffer[layer_id][loc] = self.kv_dtype.store(latent, self.k_scale[layer_id],
                                                           self.dtype)

    def get_latent(self, layer_id: int, loc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An MLA pool: the rows at slots ``loc`` (any shape), dequantized to ``dtype``."""
        assert self.latent, "get_latent is an MLA pool's; this pool holds K and V"
        rows = self.k_buffer[layer_id].index_select(0, loc.reshape(-1))
        return self.kv_dtype.load(rows.view(*loc.shape, *rows.shape[1:]),
                                  self.k_scale[layer_id], dtype)

    def get_kv(self, layer_id: int, loc: torch.Tensor, dtype: torch.dtype):
        """K and V at slots ``loc`` (any shape), dequantized to ``dtype``."""
        assert not self.latent, "an MLA pool holds latent rows: get_latent, not get_kv"
        # index_select on flat slots gathers ~3x faster than advanced indexing on CPU
        flat, shape = loc.reshape(-1), (*loc.shape, *self.k_buffer[0].shape[1:])
        k = self.k_buffer[layer_id].index_select(0, flat).view(shape)
        v = self.v_buffer[layer_id].index_select(0, flat).view(shape)
        kv = self.kv_dtype
        return (kv.load(k, self.k_scale[layer_id], dtype),
                kv.load(v, self.v_scale[layer_id], dtype))

    def bytes_per_token(self) -> int:
        k = self.k_buffer[0]
        per_layer = k.shape[1] * k.shape[2] * k.element_size()
        return (1 if self.latent else 2) * self.num_layers * per_layer
