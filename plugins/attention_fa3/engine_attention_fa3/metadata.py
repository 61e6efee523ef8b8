"""FA3's per-step metadata, built in plain torch on the batch's device from its own tensors.

flash_attn_with_kvcache reads the new tokens' queries as one varlen tensor (``cu_seqlens_q``,
``max_seqlen_q``) and every request's keys through a page table over the paged pool
(``page_table`` [B, pages] int32, ``cache_seqlens`` [B] int32 = the full sequence length: the
backend writes the new K/V into the pool itself, before the call). Page-table entries past a
request's last page are 0, the pool's scratch page, which the kernel never reads for that row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch


# fmt: off
@dataclass
class FA3Metadata:
    cu_seqlens_q: torch.Tensor   # [B+1] int32: offsets of each request's new tokens in q
    max_seqlen_q: int            # largest new-token count (host)
    cache_seqlens: torch.Tensor  # [B] int32: keys per request, new tokens included
    page_table: torch.Tensor     # [B, P] int32: pool page of each request's i-th page, else 0
    max_seqlen_k: int            # largest sequence length (host)
# fmt: on

    @classmethod
    def build(cls, batch: ForwardBatch, page_size: int) -> "FA3Metadata":
        seq = batch.seq_lens_list
        max_k = max(seq)
        cu = torch.zeros(batch.batch_size + 1, dtype=torch.int32, device=batch.seq_lens.device)
        cu[1:] = torch.cumsum(batch.extend_lens, 0)
        pages = torch.empty(batch.batch_size, -(-max_k // page_size), dtype=torch.int32,
                            device=batch.seq_lens.device)
        fill_page_table(pages, batch, page_size)
        return cls(cu, max(batch.extend_lens_list), batch.seq_lens.to(torch.int32), pages, max_k)


def fill_page_table(out: torch.Tensor, batch: ForwardBatch, page_size: int) -> None:
    """Write the batch's page table into ``out`` [B, P] in place: column i holds the page of
    each request's position i*page_size, or 0 past its sequence (only the first
    ceil(max seq len / page_size) columns are gathered; the rest are zeroed)."""
    n = -(-max(batch.seq_lens_list) // page_size)
    assert n <= out.shape[1], "a sequence is longer than the page table"
    first_pos = torch.arange(n, device=out.device) * page_size
    slots = batch.req_to_token[batch.req_pool_indices[:, None], first_pos[None, :]]
    valid = first_pos[None, :] < batch.seq_lens[:, None]
    out[:, :n] = torch.where(valid, slots // page_size, 0)
    out[:, n:] = 0


class FA3GraphBuffers:
    """Fixed metadata tensors for CUDA-graph decode batches of up to ``max_bs`` requests: a
    captured graph keeps reading the same memory, so each replay refills them in place."""

    def __init__(self, max_bs: int, max_context_len: int, page_size: int, device):
        self.page_size = page_size
        # a decode brings one token per request: the query offsets never change
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.cache_seqlens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(max_bs, -(-max_context_len // page_size),
                                      dtype=torch.int32, device=device)

    def fill(self, bs: int, batch: ForwardBatch) -> FA3Metadata:
        """Metadata for the fixed decode ``batch`` of ``bs`` rows (padding rows included), as
        views of the fixed tensors, which are refilled in place."""
        assert batch.batch_size == bs and max(batch.extend_lens_list) == 1, "a decode batch"
        self.cache_seqlens[:bs].copy_(batch.seq_lens)
        fill_page_table(self.page_table[:bs], batch, self.page_size)
        return FA3Metadata(self.cu_seqlens_q[: bs + 1], 1, self.cache_seqlens[:bs],
                           self.page_table[:bs], max(batch.seq_lens_list))
