"""Torch stand-ins for the flashinfer entry points the backends call, for tests: the same call
shapes and keyword names, computing attention from exactly the metadata the kernels would get
(indptr arithmetic, page ids, last-page lengths, block tables, bottom-right causal masks,
window_left, k/v or bmm1/bmm2 scales). Written apart from torch_native (which reads
req_to_token), so that agreeing with it proves the metadata. Slow: a Python loop per request."""

from __future__ import annotations

from types import SimpleNamespace

import torch


LOG2E = 1.4426950408889634  # flashinfer's log-sum-exp is in base 2


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window_left: int,
           v_scale: float = 1.0) -> torch.Tensor:
    """q [n, H, D]: the last n of the L positions of k, v [L, KVH, D]; causal (bottom-right),
    keys p - window_left .. p for position p (all when window_left < 0). float32 [n, H, D]."""
    return attend_lse(q, k, v, scale, window_left, v_scale)[0]


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window_left: int, v_scale: float = 1.0, causal: bool = True):
    """``attend``, and also each row's log-sum-exp of its scaled logits in base 2 (float32
    [n, H]), as flashinfer returns it with ``return_lse=True``. ``causal=False``: every key
    (no window); with no keys (L = 0) the output is 0 and the log-sum-exp -inf."""
    n, H, D = q.shape
    L, KVH = k.shape[:2]
    assert 0 < n and (n <= L or not causal), (n, L)
    if L == 0:
        return (torch.zeros(n, H, D, dtype=torch.float32, device=q.device),
                torch.full((n, H), float("-inf"), dtype=torch.float32, device=q.device))
    qf = q.float().view(n, KVH, H // KVH, D)
    s = torch.einsum("nkgd,lkd->kgnl", qf, k.float()) * scale
    qpos = torch.arange(L - n, L, device=q.device)[:, None]
    kpos = torch.arange(L, device=q.device)[None, :]
    seen = kpos <= qpos if causal else torch.ones(n, L, dtype=torch.bool, device=q.device)
    if window_left >= 0:
        assert causal, "a window is only modelled with causal attention"
        seen &= kpos >= qpos - window_left
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [KVH, G, n], natural log
    out = torch.einsum("kgnl,lkd->nkgd", s.softmax(-1), v.float()).reshape(n, H, D) * v_scale
    return out, (lse * LOG2E).permute(2, 0, 1).reshape(n, H)


def reference_merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                          s_b: torch.Tensor):
    """flashinfer.merge_state: two partial attention states over disjoint key sets (outputs
    [n, H, D], base-2 log-sum-exps [n, H] float32) -> the state over their union."""
    assert v_a.shape == v_b.shape and v_a.dtype == v_b.dtype
    assert s_a.shape == s_b.shape == v_a.shape[:2]
    assert s_a.dtype == s_b.dtype == torch.float32
    m = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp2(s_a - m), torch.exp2(s_b - m)
    v = (v_a.float() * w_a[..., None] + v_b.float() * w_b[..., None]) / (w_a + w_b)[..., None]
    return v.to(v_a.dtype), m + torch.log2(w_a + w_b)


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
                    k_scale, v_scale, causal=True):
        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1:] == (self.page_size, self.kv_heads, self.head_dim), k_cache.shape
        _check(q, self.q_dtype, "q")
        _check(k_cache, self.kv_dtype, "the KV cache")
        for t in (kv_indptr, kv_indices, last_page_len):
            assert t.dtype == torch.int32
        ptr, idx, last = kv_indptr.tolist(), kv_indices.tolist(), last_page_len.tolist()
        assert len(ptr) == len(last) + 1 == len(q_ends)
        for b, n in enumerate(last):  # 0 exactly for a request without pages
            assert (1 <= n <= self.page_size) if ptr[b + 1] > ptr[b] else n == 0, (b, n)
        scale = self.sm_scale * (1.0 if k_scale is None else k_scale)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for b in range(len(last)):
            pages = idx[ptr[b]:ptr[b + 1]]
            # flashinfer's get_seq_lens: max(pages - 1, 0) * page_size + last_page_len
            kv_len = max(len(pages) - 1, 0) * self.page_size + last[b]
            k, v = _gather_nhd(k_cache, pages, kv_len), _gather_nhd(v_cache, pages, kv_len)
            rows = slice(q_ends[b], q_ends[b + 1])
            out[rows], lse[rows] = attend_lse(q[rows], k, v, scale, self.window_left,
                                              1.0 if v_scale is None else v_scale, causal)
        return out.to(q.dtype), lse


BACKENDS = ("auto", "fa2", "fa3")  # the prefill wrappers' backend choices modelled


class ReferencePrefillWrapper(_PagedWrapper):
    """BatchPrefillWithPagedKVCacheWrapper (NHD), never captured in a CUDA graph: causal over
    whole sequences, or (causal=False) a ragged step's cached prefixes, which may be empty."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 backend="auto"):
        assert kv_layout == "NHD" and not use_cuda_graph and backend in BACKENDS
        self.backend = backend

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None,
             window_left=-1, q_data_type="float16", kv_data_type=None):
        assert qo_indptr.dtype == torch.int32
        self.causal = causal
        self.meta = (qo_indptr.tolist(), paged_kv_indptr, paged_kv_indices,
                     paged_kv_last_page_len)
        self._keep(num_qo_heads, num_kv_heads, head_dim_qk, page_size, sm_scale, window_left,
                   q_data_type, kv_data_type)

    def run(self, q, paged_kv_cache, *, k_scale=None, v_scale=None, return_lse=False):
        qo = self.meta[0]
        assert q.shape == (qo[-1], self.heads, self.head_dim), q.shape
        out, lse = self._attend_all(q, paged_kv_cache, qo, *self.meta[1:], k_scale, v_scale,
                                    self.causal)
        return (out, lse) if return_lse else out


class ReferenceRaggedWrapper:
    """BatchPrefillWithRaggedKVCacheWrapper (NHD): each request's queries against its own rows
    of the k/v tensors given to run() (the step's new tokens), causal, bottom-right."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 backend="auto"):
        assert kv_layout == "NHD" and not use_cuda_graph and backend in BACKENDS
        self.backend = backend

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, *,
             causal=False, sm_scale=None, window_left=-1, q_data_type="float16",
             kv_data_type=None):
        assert qo_indptr.dtype == kv_indptr.dtype == torch.int32
        self.qo, self.kv = qo_indptr.tolist(), kv_indptr.tolist()
        assert len(self.qo) == len(self.kv) and self.qo[0] == self.kv[0] == 0
        self.causal = causal
        self.heads, self.kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim_qk
        self.sm_scale = head_dim_qk ** -0.5 if sm_scale is None else sm_scale
        self.window_left = window_left
        self.q_dtype, self.kv_dtype = q_data_type, kv_data_type or q_data_type

    def run(self, q, k, v, *, return_lse=False):
        assert q.shape == (self.qo[-1], self.heads, self.head_dim), q.shape
        assert k.shape == v.shape == (self.kv[-1], self.kv_heads, self.head_dim), k.shape
        _check(q, self.q_dtype, "q")
        _check(k, self.kv_dtype, "k")
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for b in range(len(self.qo) - 1):
            rows, keys = slice(self.qo[b], self.qo[b + 1]), slice(self.kv[b], self.kv[b + 1])
            out[rows], lse[rows] = attend_lse(q[rows], k[keys], v[keys], self.sm_scale,
                                              self.window_left, causal=self.causal)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out


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
                                k_scale, v_scale)[0]


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


def attend_latent(q: torch.Tensor, rows: torch.Tensor, lora: int, scale: float,
                  causal: bool = True) -> torch.Tensor:
    """MLA: q [n, H, D] (absorbed), rows [L, D] (latent then rope key): softmax(q . rows *
    scale) over the rows (the last n positions causal, bottom-right), times the rows' first
    ``lora`` values. float32 [n, H, lora]."""
    n, L = q.shape[0], rows.shape[0]
    s = torch.einsum("nhd,ld->hnl", q.float(), rows.float()) * scale
    if causal:
        qpos = torch.arange(L - n, L, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(L, device=q.device)[None, :] > qpos, float("-inf"))
    return torch.einsum("hnl,ld->nhd", s.softmax(-1), rows[:, :lora].float())


class ReferenceMLAWrapper:
    """flashinfer.mla.BatchMLAPagedAttentionWrapper: plan (host indptrs, page ids, each
    sequence's length), then run over ckv/kpe caches [P, page_size, ...]."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, backend="auto"):
        assert float_workspace_buffer.dtype == torch.uint8

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type):
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == torch.int32
        assert qo_indptr.device.type == kv_indptr.device.type == kv_len_arr.device.type == "cpu"
        self.meta = (qo_indptr.tolist(), kv_indptr.tolist(), kv_indices, kv_len_arr.tolist())
        self.shape = (num_heads, head_dim_ckv, head_dim_kpe, page_size)
        self.causal, self.scale = causal, sm_scale
        self.dtypes = (q_data_type, kv_data_type)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache):
        qo, kv, indices, lens = self.meta
        heads, ckv_dim, kpe_dim, page_size = self.shape
        assert q_nope.shape[1:] == (heads, ckv_dim) and q_pe.shape[1:] == (heads, kpe_dim)
        assert ckv_cache.shape[1:] == (page_size, ckv_dim)
        assert kpe_cache.shape[1:] == (page_size, kpe_dim)
        _check(q_nope, self.dtypes[0], "q_nope")
        _check(ckv_cache, self.dtypes[1], "ckv_cache")
        assert qo[-1] == q_nope.shape[0] and len(lens) == len(qo) - 1
        q = torch.cat([q_nope, q_pe], -1)
        out = torch.empty(q.shape[0], heads, ckv_dim, dtype=q_nope.dtype, device=q.device)
        for b, n in enumerate(lens):
            pages = indices[kv[b]:kv[b + 1]].tolist()
            assert len(pages) == -(-n // page_size)
            rows = torch.cat([ckv_cache[pages], kpe_cache[pages]], -1).reshape(
                -1, ckv_dim + kpe_dim)[:n]
            out[qo[b]:qo[b + 1]] = attend_latent(q[qo[b]:qo[b + 1]], rows, ckv_dim,
                                                 self.scale, self.causal)
        return out


def reference_trtllm_mla_decode(query, kv_cache, workspace_buffer, qk_nope_head_dim,
                                kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens,
                                max_seq_len, bmm1_scale=1.0, bmm2_scale=1.0):
    """trtllm_batch_decode_with_kv_cache_mla: query [B, 1, H, lora + rope], kv_cache [P, 1,
    page_size, lora + rope]; out [B, 1, H, lora]."""
    lens = _check_tables(block_tables, seq_lens, max_seq_len)
    B, q_len, H, D = query.shape
    assert q_len == 1 and B == len(lens) and D == kv_lora_rank + qk_rope_head_dim
    assert kv_cache.shape[1] == 1 and kv_cache.shape[3] == D and qk_nope_head_dim > 0
    page_size = kv_cache.shape[2]
    out = torch.empty(B, 1, H, kv_lora_rank, dtype=query.dtype, device=query.device)
    for b, n in enumerate(lens):
        pages = block_tables[b, :-(-n // page_size)].tolist()
        rows = kv_cache[pages, 0].reshape(-1, D)[:n]
        out[b] = attend_latent(query[b], rows, kv_lora_rank, bmm1_scale) * bmm2_scale
    return out


def mla_reference_ops() -> SimpleNamespace:
    return SimpleNamespace(mla_wrapper=ReferenceMLAWrapper,
                           mla_decode=reference_trtllm_mla_decode)


def flashinfer_reference_ops() -> SimpleNamespace:
    return SimpleNamespace(prefill_wrapper=ReferencePrefillWrapper,
                           ragged_wrapper=ReferenceRaggedWrapper,
                           decode_wrapper=ReferenceDecodeWrapper,
                           merge_state=reference_merge_state)


def trtllm_reference_ops() -> SimpleNamespace:
    return SimpleNamespace(decode=reference_trtllm_decode, context=reference_trtllm_context)
