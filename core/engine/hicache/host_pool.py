"""The host tier's KV slots: per-layer K and V tensors in host memory (pinned on a GPU), in
pages of the device pool's page size (the copies between them and the device pool run beside
the step: ``copier.py``).

Unlike the device pool there is no scratch page and no request table: the host tier only
holds radix nodes (``HiRadixCache``), so free + held by the tree = size.
"""

from __future__ import annotations

import torch


class HostKVPool:
    def __init__(self, device_pool, num_tokens: int):
        page = device_pool.page_size
        self.page_size = page
        self.num_pages = num_tokens // page
        self.size = self.num_pages * page
        pin = str(device_pool.device).startswith("cuda") and torch.cuda.is_available()

        def like(buf):
            return torch.empty((self.size, *buf.shape[1:]), dtype=buf.dtype, pin_memory=pin)

        self.k = [like(b) for b in device_pool.k_buffer]
        self.v = [like(b) for b in device_pool.v_buffer]
        self._free = torch.arange(self.num_pages - 1, -1, -1, dtype=torch.int64)
        self._top = self.num_pages

    @property
    def free_slots(self) -> int:
        return self._top * self.page_size

    def bytes_per_token(self) -> int:
        return sum(b[0].numel() * b.element_size() for b in (*self.k, *self.v))

    def alloc(self, tokens: int) -> torch.Tensor | None:
        """Slots for ``tokens`` (whole pages), or None when too few are free."""
        n = tokens // self.page_size
        if n > self._top:
            return None
        pages = self._free[self._top - n: self._top].flip(0)
        self._top -= n
        return self._slots(pages)

    def free(self, slots: torch.Tensor) -> None:
        pages = slots[:: self.page_size] // self.page_size
        n = len(pages)
        assert self._top + n <= self.num_pages, "host slots freed twice"
        self._free[self._top: self._top + n] = pages
        self._top += n

    def _slots(self, pages: torch.Tensor) -> torch.Tensor:
        p = self.page_size
        if p == 1:
            return pages
        return (pages[:, None] * p + torch.arange(p)).reshape(-1)

    # -- reads -------------------------------------------------------------------------------
    def read(self, host_slots: torch.Tensor) -> tuple[list, list]:
        """Per layer, K and V of ``host_slots`` (copies)."""
        idx = host_slots.to(torch.int64)
        return [b.index_select(0, idx) for b in self.k], [b.index_select(0, idx) for b in self.v]
