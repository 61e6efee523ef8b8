"""Per-step metadata for flashinfer's wrappers and the TensorRT-LLM kernels, built from a
ForwardBatch, and the view of the KV pool they read.

A request's pages are ``req_to_token[row, 0:seq_len:page_size] // page_size``; its last page holds
``(seq_len - 1) % page_size + 1`` tokens. The page ids are gathered on the batch's device from its
own tensors. flashinfer's indptr arrays and last-page lengths are built on the host from the
batch's host lists: ``plan()`` reads them on the host to split the work (handing it device
tensors would cost a device-to-host sync per plan) and copies them to the device itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch, ForwardMode


# fmt: off
@dataclass
class PagedKV:
    """flashinfer's page table, CSR style."""
    qo_indptr: torch.Tensor         # int32 [B+1], host: request b's new tokens are q[qo[b]:qo[b+1]]
    kv_indptr: torch.Tensor         # int32 [B+1], host: its pages are kv_indices[kv[b]:kv[b+1]]
    kv_indices: torch.Tensor        # int32 [pages], device: every request's page ids, in order
    kv_last_page_len: torch.Tensor  # int32 [B], host: tokens in its last page, 1..page_size


@dataclass
class BlockTables:
    """The TensorRT-LLM kernels' page table: one padded row of page ids per request."""
    block_tables: torch.Tensor      # int32 [B, W], device: page ids, 0 (scratch page) past the end
    seq_lens: torch.Tensor          # int32 [B], device: keys per request (prefix + new tokens)
    cum_seq_lens_q: torch.Tensor | None   # int32 [B+1], device: new-token offsets (None: decode)
    cum_seq_lens_kv: torch.Tensor | None  # int32 [B+1], device: key offsets (None: decode)
    max_q_len: int
    max_kv_len: int
# fmt: on


def pages_per_request(seq_lens: list[int], page_size: int) -> list[int]:
    return [-(-s // page_size) for s in seq_lens]


def _host_indptr(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *accumulate(counts)], dtype=torch.int32)


def paged_kv(batch: ForwardBatch, page_size: int, prefix_only: bool = False) -> PagedKV:
    """The batch's pages: of each whole sequence, or with ``prefix_only`` of each request's
    cached prefix only (the ragged path's paged half): a request without one has no pages and
    a last-page length of 0, so that flashinfer's ``get_seq_lens`` (``max(pages - 1, 0) *
    page_size + last_page_len``) gives it 0 keys."""
    lens = batch.prefix_lens_list if prefix_only else batch.seq_lens_list
    lens_t = batch.prefix_lens if prefix_only else batch.seq_lens
    npages = pages_per_request(lens, page_size)
    dev = lens_t.device
    npages_t = (lens_t + page_size - 1) // page_size
    total = sum(npages)
    # which request each page belongs to, and its place in that request (no device sync: the
    # output size is known on the host)
    owner = torch.repeat_interleave(torch.arange(batch.batch_size, device=dev), npages_t,
                                    output_size=total)
    first = torch.cumsum(npages_t, 0) - npages_t
    col = torch.arange(total, device=dev) - first[owner]
    slots = batch.req_to_token[batch.req_pool_indices[owner], col * page_size]
    return PagedKV(
        qo_indptr=_host_indptr(batch.extend_lens_list),
        kv_indptr=_host_indptr(npages),
        kv_indices=(slots // page_size).to(torch.int32),
        kv_last_page_len=torch.tensor([(s - 1) % page_size + 1 if s else 0 for s in lens],
                                      dtype=torch.int32),
    )


def page_table(batch: ForwardBatch, page_size: int, width: int) -> torch.Tensor:
    """int32 [B, width]: each request's page ids, 0 past its last page."""
    dev = batch.seq_lens.device
    first_slot = torch.arange(width, device=dev) * page_size
    slots = batch.req_to_token[batch.req_pool_indices[:, None], first_slot[None, :]]
    inside = first_slot[None, :] < batch.seq_lens[:, None]
    return torch.where(inside, slots // page_size, 0).to(torch.int32)


def _device_indptr(lens: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))


def block_tables(batch: ForwardBatch, page_size: int) -> BlockTables:
    seq = batch.seq_lens_list
    decode = batch.mode == ForwardMode.DECODE
    return BlockTables(
        block_tables=page_table(batch, page_size, max(pages_per_request(seq, page_size))),
        seq_lens=batch.seq_lens.to(torch.int32),
        cum_seq_lens_q=None if decode else _device_indptr(batch.extend_lens),
        cum_seq_lens_kv=None if decode else _device_indptr(batch.seq_lens),
        max_q_len=max(batch.extend_lens_list),
        max_kv_len=max(seq),
    )


def window_left(sliding_window: int | None) -> int:
    """flashinfer's window_left: a token at position p sees keys p - window_left .. p."""
    return -1 if sliding_window is None else sliding_window - 1


def paged_cache(pool, layer_id: int, read_as_hnd: bool = False):
    """The layer's K and V slot buffers viewed as [num_pages + 1, page_size, KVH, D] (NHD) paged
    caches, no copy. ``read_as_hnd``: the kernel reads them through a transposed (HND) view, as
    the TensorRT-LLM ones do; with one KV head, the size-1 dim then gets the stride of a whole
    page so that the transposed view has canonical strides (their TMA descriptors reject a
    size-1 dim whose stride equals the next one's: flashinfer #2232)."""
    ps = pool.page_size
    out = []
    for buf in (pool.k_buffer[layer_id], pool.v_buffer[layer_id]):
        kvh, d = buf.shape[1:]
        view = buf.view(-1, ps, kvh, d)
        if kvh == 1 and read_as_hnd:
            view = view.as_strided(view.shape, (ps * d, d, ps * d, 1))
        out.append(view)
    return out[0], out[1]
