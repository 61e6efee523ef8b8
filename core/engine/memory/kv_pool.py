"""The KV-cache pool: per-layer K and V slot tensors, a page allocator and the request table.

A slot holds one token's K and V for one layer. Slots are handed out in pages of ``page_size``
slots (page p owns slots ``p*page_size .. p*page_size+page_size-1``); page 0 is never handed out,
so slot 0 is a scratch slot that padded metadata can point at harmlessly. Likewise request row
``scratch_row`` (one past the last real row) is never handed out and maps every position to
slot 0: the padding rows of a CUDA-graph decode batch use it.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int,
                 dtype: torch.dtype, device="cpu", page_size: int = 1, max_reqs: int = 256,
                 max_context_len: int = 4096, needs_scale: bool = False):
        assert num_tokens >= page_size > 0
        self.page_size = page_size
        self.num_pages = num_tokens // page_size
        self.size = self.num_pages * page_size  # usable token slots
        self.dtype = dtype
        self.device = device
        self.num_layers = num_layers
        self.needs_scale = needs_scale
        shape = ((self.num_pages + 1) * page_size, num_kv_heads, head_dim)
        # torch.empty: never zero-fill gigabytes at start
        self.k_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in (*self.k_buffer, *self.v_buffer):
            # padded metadata reads the scratch page; masked keys get probability 0, but
            # 0 * NaN is NaN, so it must hold finite values
            buf[:page_size].zero_()
        # per-layer dequantization scales (stay 1.0 unless a KV dtype that needs them sets them)
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        # scaled values are clamped to the storage range: an overflow would store inf (or NaN)
        self._max = torch.finfo(dtype).max if needs_scale and dtype.is_floating_point else None
        # a stack of free page ids in a tensor: compact and O(n) per call even for millions of pages
        self._free_stack = torch.arange(self.num_pages, 0, -1, dtype=torch.int64)
        self._top = self.num_pages  # _free_stack[:_top] are free; the top hands out low pages first
        self.max_context_len = max_context_len
        # int32 slots (a pool holds far fewer than 2^31): at 128k context and 4096 requests the
        # table is 2 GiB, not 4; its bytes are in the sizing report (req_to_token_bytes)
        self.req_to_token = torch.zeros((max_reqs + 1, max_context_len), dtype=torch.int32,
                                        device=device)
        self.scratch_row = max_reqs  # stays all zeros: position -> the scratch slot 0
        self._free_reqs = list(range(max_reqs - 1, -1, -1))
        self.max_reqs = max_reqs

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
        return pages

    def free_pages(self, pages) -> None:
        pages = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
        n = pages.numel()
        assert self._top + n <= self.num_pages, "a page was freed twice"
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
            held = self.req_to_token[row, : first_new_page * p : p].cpu() // p
            page_of = torch.cat([held, new_pages])
            slots = page_of[positions // p] * p + positions % p
        self.req_to_token[row, seq_len: seq_len + n] = slots.to(self.req_to_token.device)
        return slots

    def slots_to_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """The distinct pages of ``slots`` (which must cover whole pages or a sequence tail)."""
        if self.page_size == 1:
            return slots
        return torch.unique(slots // self.page_size)

    def free_slots_of(self, slots: torch.Tensor) -> None:
        self.free_pages(self.slots_to_pages(slots.cpu()))

    # -- request rows -------------------------------------------------------------------------
    def alloc_req(self) -> int | None:
        return self._free_reqs.pop() if self._free_reqs else None

    def free_req(self, row: int) -> None:
        self._free_reqs.append(row)
        assert len(self._free_reqs) <= self.max_reqs, "a request row was freed twice"

    @property
    def free_reqs(self) -> int:
        return len(self._free_reqs)

    # -- K/V access ----------------------------------------------------------------------------
    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.needs_scale:
            k = k / self.k_scale[layer_id]
            v = v / self.v_scale[layer_id]
            if self._max is not None:
                k, v = k.clamp(-self._max, self._max), v.clamp(-self._max, self._max)
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)

    def get_kv(self, layer_id: int, loc: torch.Tensor, dtype: torch.dtype):
        """K and V at slots ``loc`` (any shape), dequantized to ``dtype``."""
        # index_select on flat slots gathers ~3x faster than advanced indexing on CPU
        flat, shape = loc.reshape(-1), (*loc.shape, *self.k_buffer[0].shape[1:])
        k = self.k_buffer[layer_id].index_select(0, flat).view(shape).to(dtype)
        v = self.v_buffer[layer_id].index_select(0, flat).view(shape).to(dtype)
        if self.needs_scale:
            k = k * self.k_scale[layer_id]
            v = v * self.v_scale[layer_id]
        return k, v

    def bytes_per_token(self) -> int:
        k = self.k_buffer[0]
        return 2 * self.num_layers * k.shape[1] * k.shape[2] * k.element_size()
