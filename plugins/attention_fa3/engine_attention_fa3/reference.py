"""A torch model of the part of sgl-kernel's ``flash_attn_with_kvcache`` (FlashAttention-3) that
the fa3 backend uses, with the same keyword names, for tests only (never a run-time fallback).

Covered: varlen queries (``cu_seqlens_q``, ``max_seqlen_q``), a paged K/V cache read through
``page_table`` up to ``cache_seqlens`` keys per request, GQA, ``softmax_scale``, the causal mask
aligned to the bottom right, ``window_size=(left, right)`` (query i of a request with Lq new
tokens and Lk keys sees keys i + Lk - Lq - left .. i + Lk - Lq + right), and fp8 inputs with
per-(request, KV head) ``q_descale`` / ``k_descale`` / ``v_descale``. Not covered (asserted
off): appending k/v, rotary, softcap, cache_batch_idx/leftpad, returning the LSE.

Like the kernel it needs q and the cache in one dtype, returns bfloat16 for fp8 queries (the
query dtype otherwise) and zeros for a query row that sees no key. Unlike the kernel it also
accepts float32, so CPU tests can compare it exactly with torch_native.
"""

from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def flash_attn_with_kvcache_reference(
    q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, page_table, cu_seqlens_q,
    max_seqlen_q, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
    causal=False, window_size=(-1, -1),
):
    assert k is None and v is None, "appending new K/V is not modelled (the backend writes them)"
    T, H, D = q.shape
    num_pages, page_size, KVH, _ = k_cache.shape
    B = cache_seqlens.shape[0]
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the K/V cache must share a dtype"
    assert k_cache.shape == v_cache.shape and H % KVH == 0
    assert cache_seqlens.dtype == page_table.dtype == cu_seqlens_q.dtype == torch.int32
    assert cu_seqlens_q.shape == (B + 1,) and page_table.shape[0] == B
    for d in (q_descale, k_descale, v_descale):
        assert d is None or (d.shape == (B, KVH) and d.dtype == torch.float32)
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0
    cu, lens = cu_seqlens_q.tolist(), cache_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == T, "cu_seqlens_q must cover q exactly"
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    group = H // KVH
    for b in range(B):
        lq, lk = cu[b + 1] - cu[b], lens[b]
        assert 0 < lq <= max_seqlen_q and lq <= lk
        pages = page_table[b, : -(-lk // page_size)].long()
        assert int(pages.max()) < num_pages, "page id out of range"
        keys = _dequant(k_cache[pages].reshape(-1, KVH, D)[:lk], k_descale, b)  # [Lk, KVH, D]
        vals = _dequant(v_cache[pages].reshape(-1, KVH, D)[:lk], v_descale, b)
        qs = _dequant(q[cu[b]: cu[b + 1]].unflatten(1, (KVH, group)), q_descale, b)
        scores = torch.einsum("ikgd,jkd->kgij", qs, keys) * scale  # [KVH, G, Lq, Lk]
        qpos = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        kpos = torch.arange(lk, device=q.device)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if right >= 0:
            allowed &= kpos <= qpos + right
        if left >= 0:
            allowed &= kpos >= qpos - left
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        probs = torch.nan_to_num(probs)  # a row with no allowed key: softmax of all -inf
        o = torch.einsum("kgij,jkd->ikgd", probs, vals)
        out[cu[b]: cu[b + 1]] = o.reshape(lq, H, D)
    return out.to(torch.bfloat16 if q.dtype in FP8 else q.dtype)


def _dequant(x: torch.Tensor, descale: torch.Tensor | None, b: int) -> torch.Tensor:
    """float32 values of ``x`` (KV heads on dim 1) times request ``b``'s per-KV-head descale."""
    x = x.float()
    if descale is None:
        return x
    d = descale[b].view(1, -1, *([1] * (x.dim() - 2)))
    return x * d
