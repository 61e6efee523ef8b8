"""Torch stand-ins for the flashinfer entry points the backends call, for tests: the same call
shapes and keyword names, computing attention from exactly the metadata the kernels would get
(indptr arithmetic, page ids, last-page lengths, block tables, bottom-right causal masks,
window_left, k/v or bmm1/bmm2 scales). Written apart from torch_native (which reads
req_to_token), so that agreeing with it proves the metadata. Slow: a Python loop per request."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window_left: int,
           v_scale: float = 1.0) -> torch.Tensor:
    """q [n, H, D]: the last n of the L positions of k, v [L, KVH, D]; causal (bottom-right),
    keys p - window_left .. p for position p (all when window_left < 0). float32 [n, H, D]."""
    n, H, D = q.shape
    L, KVH = k.shape[:2]
    assert 0 < n <= L, (n, L)
    qf = q.float().view(n, KVH, H // KVH, D)
    s = torch.einsum("nkgd,lkd->kgnl", qf, k.float()) * scale
    qpos = torch.arange(L - n, L, device=q.device)[:, None]
    kpos = torch.arange(L, device=q.device)[None, :]
    seen = kpos <= qpos
    if window_left >= 0:
        seen &= kpos >= qpos - window_left
    p = s.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("kgnl,lkd->nkgd", p, v.float()).reshape(n, H, D) * v_scale


def _gather_nhd(cache: torch.Tensor, pages: list[int], n: int) -> torch.Tensor:
    """The first n tokens of ``pages`` of an NHD cache [P, page_size, KVH, D]: [n, KVH, D]."""
    return cache[pages].reshape(-1, *cache.shape[2:])[:n]


def _check(t: torch.Tensor, dtype, what: str) -> None:
    assert dtype is None or t.dtype == dtype, f"{what} is {t.dtype}, planned {dtype}"


class _PagedWrapper:
    """What plan() keeps and run() reads, shared by the prefill and decode stand-ins."""

    def _keep(self, num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale, window_left,
              q_data_type, kv_data_type):
        self.heads, self.kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size = page_size
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
        self.window_left = window_left
        self.q_dtype, self.kv_dtype = q_data_type, kv_data_type or q_data_type

    def _attend_all(self, q, paged_kv_cache, q_ends, kv_indptr, kv_indices, last_page_len,
                    k_scale, v_scale):
        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1:] == (self.page_size, self.kv_heads, self.head_dim), k_cache.shape
        _check(q, self.q_dtype, "q")
        _check(k_cache, self.kv_dtype, "the KV cache")
        for t in (kv_indptr, kv_indices, last_page_len):
            assert t.dtype == torch.int32
        ptr, idx, last = kv_indptr.tolist(), kv_indices.tolist(), last_page_len.tolist()
        assert len(ptr) == len(last) + 1 == len(q_ends)
        assert all(1 <= n <= self.page_size for n in last), last
        scale = self.sm_scale * (1.0 if k_scale is None else k_scale)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for b in range(len(last)):
            pages = idx[ptr[b]:ptr[b + 1]]
            kv_len = (len(pages) - 1) * self.page_size + last[b]
            k, v = _gather_nhd(k_cache, pages, kv_len), _gather_nhd(v_cache, pages, kv_len)
            rows = slice(q_ends[b], q_ends[b + 1])
            out[rows] = attend(q[rows], k, v, scale, self.window_left,
                               1.0 if v_scale is None else v_scale)
        return out.to(q.dtype)


class ReferencePrefillWrapper(_PagedWrapper):
    """BatchPrefillWithPagedKVCacheWrapper (NHD, causal), never captured in a CUDA graph."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False):
        assert kv_layout == "NHD" and not use_cuda_graph

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None,
             window_left=-1, q_data_type="float16", kv_data_type=None):
        assert causal, "only causal attention is implemented"
        assert qo_indptr.dtype == torch.int32
        self.meta = (qo_indptr.tolist(), paged_kv_indptr, paged_kv_indices,
                     paged_kv_last_page_len)
        self._keep(num_qo_heads, num_kv_heads, head_dim_qk, page_size, sm_scale, window_left,
                   q_data_type, kv_data_type)

    def run(self, q, paged_kv_cache, *, k_scale=None, v_scale=None):
        qo = self.meta[0]
        assert q.shape == (qo[-1], self.heads, self.head_dim), q.shape
        return self._attend_all(q, paged_kv_cache, qo, *self.meta[1:], k_scale, v_scale)


class ReferenceDecodeWrapper(_PagedWrapper):
    """BatchDecodeWithPagedKVCacheWrapper (NHD). With ``use_cuda_graph`` plan() copies the
    metadata into the caller's fixed buffers and run() reads only those, as the kernel does."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        assert kv_layout == "NHD"
        self.graph = use_cuda_graph
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                            paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, window_left=-1, sm_scale=None, q_data_type="float16",
             kv_data_type=None):
        if self.graph:
            ptr_buf, idx_buf, last_buf = self.buffers
            assert len(last_page_len) == len(last_buf), "the batch size is fixed in a graph"
            assert len(indices) <= len(idx_buf)
            ptr_buf.copy_(indptr)
            last_buf.copy_(last_page_len)
            idx_buf[:len(indices)].copy_(indices)
            self.meta = self.buffers
        else:
            self.meta = (indptr, indices, last_page_len)
        self._keep(num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale, window_left,
                   q_data_type, kv_data_type)

    def run(self, q, paged_kv_cache, *, k_scale=None, v_scale=None):
        indptr, indices, last = self.meta
        B = len(last)
        assert q.shape == (B, self.heads, self.head_dim), q.shape
        return self._attend_all(q, paged_kv_cache, list(range(B + 1)), indptr, indices, last,
                                k_scale, v_scale)


def _gather_hnd(k_cache, v_cache, kv_layout, table_row: torch.Tensor, n: int):
    """The first n keys of a block-table row, read through the HND view the kernels take."""
    if kv_layout == "NHD":
        k_cache, v_cache = k_cache.transpose(-3, -2), v_cache.transpose(-3, -2)
    _, kvh, page_size, d = k_cache.shape  # HND: [pages, KVH, page_size, D]
    pages = table_row[:-(-n // page_size)].tolist()
    return [c[pages].transpose(1, 2).reshape(-1, kvh, d)[:n] for c in (k_cache, v_cache)]


def _check_tables(block_tables, seq_lens, max_kv_len):
    assert block_tables.dtype == seq_lens.dtype == torch.int32
    assert block_tables.shape[0] == seq_lens.shape[0]
    lens = seq_lens.tolist()
    assert max(lens) <= max_kv_len, (lens, max_kv_len)
    return lens


def reference_trtllm_decode(query, kv_cache, workspace_buffer, block_tables, seq_lens,
                            max_seq_len, bmm1_scale=1.0, bmm2_scale=1.0, window_left=-1,
                            out_dtype=None, kv_layout="HND"):
    """trtllm_batch_decode_with_kv_cache: one query per request, the last of its seq_lens."""
    lens = _check_tables(block_tables, seq_lens, max_seq_len)
    assert query.shape[0] == len(lens)
    out = torch.empty(query.shape, dtype=out_dtype or query.dtype, device=query.device)
    for b, n in enumerate(lens):
        k, v = _gather_hnd(*kv_cache, kv_layout, block_tables[b], n)
        out[b:b + 1] = attend(query[b:b + 1], k, v, bmm1_scale, window_left, bmm2_scale)
    return out


def reference_trtllm_context(query, kv_cache, workspace_buffer, block_tables, seq_lens,
                             max_q_len, max_kv_len, bmm1_scale, bmm2_scale, batch_size,
                             cum_seq_lens_q, cum_seq_lens_kv, window_left=-1, out_dtype=None,
                             kv_layout="HND"):
    """trtllm_batch_context_with_kv_cache: request b's queries q[cum_q[b]:cum_q[b+1]] are the
    last ones of its seq_lens[b] keys (a cached prefix before them)."""
    lens = _check_tables(block_tables, seq_lens, max_kv_len)
    cq, ckv = cum_seq_lens_q.tolist(), cum_seq_lens_kv.tolist()
    assert cum_seq_lens_q.dtype == cum_seq_lens_kv.dtype == torch.int32
    assert batch_size == len(lens) == len(cq) - 1 and cq[-1] == query.shape[0]
    assert [ckv[b + 1] - ckv[b] for b in range(batch_size)] == lens
    out = torch.empty(query.shape, dtype=out_dtype or query.dtype, device=query.device)
    for b, n in enumerate(lens):
        assert 0 < cq[b + 1] - cq[b] <= max_q_len
        k, v = _gather_hnd(*kv_cache, kv_layout, block_tables[b], n)
        out[cq[b]:cq[b + 1]] = attend(query[cq[b]:cq[b + 1]], k, v, bmm1_scale, window_left,
                                      bmm2_scale)
    return out


def flashinfer_reference_ops() -> SimpleNamespace:
    return SimpleNamespace(prefill_wrapper=ReferencePrefillWrapper,
                           decode_wrapper=ReferenceDecodeWrapper)


def trtllm_reference_ops() -> SimpleNamespace:
    return SimpleNamespace(decode=reference_trtllm_decode, context=reference_trtllm_context)
