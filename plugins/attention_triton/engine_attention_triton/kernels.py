"""Paged attention in Triton over the engine's KV pool: one kernel for prompt chunks (over a
cached prefix, causal) and decodes alike.

A program owns one request, one KV head and a block of BLOCK_M *rows*, where a row is a (new
token, query head of that KV head's group) pair: row r is token r // G, head kv_head * G + r % G.
So the G query heads that share a KV head (GQA) read each K and V row once, and a decode (one
token) fills G rows of the block instead of one. Keys are visited in blocks of BLOCK_N positions,
their slots read from ``req_to_token`` (any page size: the table maps each position to its slot),
with an online softmax in float32. Causal: a token at position p sees keys 0..p; with a sliding
window w it sees p-w+1..p. K and V are loaded in the pool's dtype (float8 included), converted to
float32 and multiplied by the layer's dequantization scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention(Q, K, V, O, req_to_token, req_rows, q_starts, ext_lens, prefix_lens,
                     stride_r2t, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot,
                     stride_oh, sm_scale, k_scale, v_scale, window,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.program_id(2)
    ext = tl.load(ext_lens + b)
    if mblk * BLOCK_M >= ext * G:
        return
    prefix = tl.load(prefix_lens + b)
    start = tl.load(q_starts + b)
    row = tl.load(req_rows + b)

    offs_r = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = offs_r // G
    head = kvh * G + offs_r % G
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = offs_r < ext * G
    d_mask = offs_d < D
    q = tl.load(Q + (start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32)
    qpos = prefix + tok

    # the keys any row of the block may see
    last_tok = tl.minimum((mblk + 1) * BLOCK_M - 1, ext * G - 1) // G
    hi = prefix + last_tok + 1
    lo = prefix * 0
    if window > 0:
        lo = tl.maximum(prefix + (mblk * BLOCK_M) // G - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=n_mask, other=0)
        kv_off = slots.to(tl.int64) * stride_kt + kvh * stride_kh
        k = tl.load(K + kv_off[None, :] + offs_d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        s = tl.dot(q, k.to(tl.float32) * k_scale) * sm_scale  # [BLOCK_M, BLOCK_N]
        allowed = n_mask[None, :] & (offs_n[None, :] <= qpos[:, None])
        if window > 0:
            allowed = allowed & (offs_n[None, :] > qpos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32) * v_scale)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + (start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


BLOCK_M = 32
BLOCK_N = 32


def paged_attention(q: torch.Tensor, out: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, req_to_token: torch.Tensor, req_rows: torch.Tensor,
                    q_starts: torch.Tensor, ext_lens: torch.Tensor, prefix_lens: torch.Tensor,
                    max_ext: int, scale: float, window: int | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """For each request b: its ``ext_lens[b]`` new tokens, at rows ``q_starts[b]..`` of ``q``
    [T, H, D], attend causally to the first ``prefix_lens[b] + ext_lens[b]`` positions of
    ``req_to_token[req_rows[b]]`` (K/V in ``k_pool``/``v_pool`` [slots, KVH, D]); results go to
    the same rows of ``out``. ``max_ext``: the largest ``ext_lens`` (a host int: no sync)."""
    T, H, D = q.shape
    KVH = k_pool.shape[1]
    assert H % KVH == 0 and q.stride(2) == 1 and out.stride(2) == 1 and k_pool.stride(2) == 1
    assert k_pool.stride() == v_pool.stride()
    G = H // KVH
    B = ext_lens.shape[0]
    grid = (B, KVH, triton.cdiv(max_ext * G, BLOCK_M))
    _paged_attention[grid](
        q, k_pool, v_pool, out, req_to_token, req_rows, q_starts, ext_lens, prefix_lens,
        req_to_token.stride(0), q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        out.stride(0), out.stride(1), scale, k_scale, v_scale, window or 0,
        G=G, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
