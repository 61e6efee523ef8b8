"""Paged attention in Triton over the engine's KV pool.

Two paths, both reading K/V in place through ``req_to_token`` (any page size: the table maps
each position to its slot), with an online softmax in float32:

- ``_paged_attention``, for any step (prompt chunks over a cached prefix, causal, and decodes):
  a program owns one request, one KV head and a block of BLOCK_M *rows*, where a row is a (new
  token, query head of that KV head's group) pair: row r is token r // G, head kv_head * G +
  r % G. So the G query heads that share a KV head (GQA) read each K and V row once. A prompt
  chunk's programs each re-read the keys up to their last token: BLOCK_M is 128 rows for prompt
  chunks (on a GPU with head dim <= 128), so a program covers 128 / G tokens per K/V read, and
  is cut down for decode-only steps. The grid is one dimension (x, up to 2^31 - 1 programs):
  CUDA bounds y and z to 65535, which a 3-D (request, KV head, row block) grid passed with long
  chunks and wide groups (e.g. 40k tokens x 64 heads per KV head / 32 rows).
- split-KV decode (flash-decoding, SGLang's decode_attention stage 1 / stage 2 design), for
  steps where every request brings one token: ``_decode_split`` runs (request, KV head x head
  block, split) programs, each over one of ``num_splits`` chunks of the request's keys, and
  writes its normalized partial output and log-sum-exp to a scratch buffer; ``_decode_reduce``
  combines a request's splits per head. Without it a decode step has batch x KV heads programs
  (8 for one request of Llama-3-8B on a GPU of 132 SMs). The split count comes from the batch
  size and the SM count (geometry.num_kv_splits); a request splits its own length, so one count
  serves every request of a step, and a captured CUDA graph (fixed grid) replays any lengths.

Matmul precision: ``tl.dot`` on float32 operands runs as TF32 on a GPU by default (10 mantissa
bits: errors around 1e-3), which Triton's CPU interpreter does not model. Operands are in the
queries' dtype: float16/bfloat16 models multiply half-precision operands (K/V converted to it,
fp8 included; the probabilities cast to it before P @ V, as SGLang does) with float32
accumulation; float32 models ask for ``input_precision="ieee"``. K/V dequantization scales
multiply the products (scalars per layer), not the operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_attention_triton.geometry import (GRID_X_MAX, GRID_YZ_MAX, block_sizes,
                                              decode_grids, decode_head_block,
                                              num_kv_splits, prefill_grid)  # noqa: F401


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in float32; IEEE: full float32 products (else the default, TF32 for
    float32 operands on a GPU: only half-precision operands come here without IEEE)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _paged_attention(Q, K, V, O, req_to_token, req_rows, q_starts, ext_lens, prefix_lens,
                     stride_r2t, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot,
                     stride_oh, sm_scale, k_scale, v_scale, window, num_kv_heads, num_mblocks,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # one grid dimension: program = (request * KV heads + KV head) * row blocks + row block
    pid = tl.program_id(0)
    mblk = pid % num_mblocks
    kvh = (pid // num_mblocks) % num_kv_heads
    b = pid // (num_mblocks * num_kv_heads)
    ext = tl.load(ext_lens + b)
    if mblk * BLOCK_M >= ext * G:
        return
    prefix = tl.load(prefix_lens + b)
    start = tl.load(q_starts + b)
    row = tl.load(req_rows + b)
    DOT = Q.dtype.element_ty  # the operands' dtype: the queries'

    offs_r = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = offs_r // G
    head = kvh * G + offs_r % G
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = offs_r < ext * G
    d_mask = offs_d < D
    q = tl.load(Q + (start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    qpos = prefix + tok
    qk_scale = sm_scale * k_scale

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
        s = _mm(q, k.to(DOT), IEEE) * qk_scale  # [BLOCK_M, BLOCK_N]
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
        acc = acc * alpha[:, None] + _mm(p.to(DOT), v.to(DOT), IEEE) * v_scale
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + (start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_split(Q, K, V, Part, Lse, req_to_token, req_rows, prefix_lens,
                  stride_r2t, stride_qt, stride_qh, stride_kt, stride_kh,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                  sm_scale, k_scale, v_scale, window, num_splits,
                  G: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Stage 1: request b's one query (row b of Q), the heads of one head block of one KV head,
    over split ``s`` of its keys: the normalized partial output and its log-sum-exp."""
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HB
    hb = tl.program_id(1) % HB
    split = tl.program_id(2)
    seq = tl.load(prefix_lens + b) + 1  # keys: the prefix and the new token
    row = tl.load(req_rows + b)
    DOT = Q.dtype.element_ty
    lo = seq * 0
    if window > 0:
        lo = tl.maximum(seq - window, 0)
    # the request's keys lo..seq in num_splits chunks of whole key blocks
    chunk = tl.cdiv(tl.cdiv(seq - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq)

    offs_g = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head = kvh * G + offs_g
    g_mask = offs_g < G
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q = tl.load(Q + b * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = sm_scale * k_scale
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=n_mask, other=0)
        kv_off = slots.to(tl.int64) * stride_kt + kvh * stride_kh
        k = tl.load(K + kv_off[None, :] + offs_d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        s = _mm(q, k.to(DOT), IEEE) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block holds a key
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + _mm(p.to(DOT), v.to(DOT), IEEE) * v_scale
        m_i = m_new
    seen = l_i > 0  # an empty split (past the request's end): lse -inf, weight 0 in stage 2
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(Part + b * stride_pb + head[:, None] * stride_ph + split * stride_ps
             + offs_d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(Lse + b * stride_lb + head * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_reduce(Part, Lse, O, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                   stride_ot, stride_oh, num_splits,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Stage 2: request b, head h: its splits' outputs weighted by exp(lse - max lse)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < D
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    part = tl.load(Part + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
                   + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.max(lse, 0)  # finite: split 0 always holds the request's last key
    w = tl.exp(lse - m)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + b * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty),
             mask=d_mask)


def paged_attention(q: torch.Tensor, out: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, req_to_token: torch.Tensor, req_rows: torch.Tensor,
                    q_starts: torch.Tensor, ext_lens: torch.Tensor, prefix_lens: torch.Tensor,
                    max_ext: int, scale: float, window: int | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0, num_splits: int = 1) -> None:
    """For each request b: its ``ext_lens[b]`` new tokens, at rows ``q_starts[b]..`` of ``q``
    [T, H, D], attend causally to the first ``prefix_lens[b] + ext_lens[b]`` positions of
    ``req_to_token[req_rows[b]]`` (K/V in ``k_pool``/``v_pool`` [slots, KVH, D]); results go to
    the same rows of ``out``. ``max_ext``: the largest ``ext_lens`` (a host int: no sync).
    ``num_splits`` > 1 (decode steps only: ``max_ext`` 1, request b's token at row b): the
    split-KV path with that many splits per request."""
    T, H, D = q.shape
    KVH = k_pool.shape[1]
    assert H % KVH == 0 and q.stride(2) == 1 and out.stride(2) == 1 and k_pool.stride(2) == 1
    assert k_pool.stride() == v_pool.stride()
    G = H // KVH
    B = ext_lens.shape[0]
    block_d = max(16, triton.next_power_of_2(D))
    ieee = q.dtype == torch.float32
    if num_splits > 1:
        assert max_ext == 1, "split-KV is for decode steps (one new token per request)"
        decode_split(q, out, k_pool, v_pool, req_to_token, req_rows, prefix_lens, scale,
                     window, k_scale, v_scale, num_splits)
        return
    block_m, block_n, warps = block_sizes(max_ext, G, D)
    grid = prefill_grid(B, KVH, G, max_ext, block_m)
    assert grid[0] <= GRID_X_MAX
    _paged_attention[grid](
        q, k_pool, v_pool, out, req_to_token, req_rows, q_starts, ext_lens, prefix_lens,
        req_to_token.stride(0), q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        out.stride(0), out.stride(1), scale, k_scale, v_scale, window or 0, KVH,
        triton.cdiv(max_ext * G, block_m),
        G=G, D=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=ieee,
        num_warps=warps)


def decode_split(q, out, k_pool, v_pool, req_to_token, req_rows, prefix_lens, scale, window,
                 k_scale, v_scale, num_splits):
    """The split-KV decode: stage 1 into float32 scratch (allocated here: inside a CUDA-graph
    capture it comes from the graph's pool, fixed for every replay), then stage 2 into out."""
    T, H, D = q.shape
    KVH = k_pool.shape[1]
    G = H // KVH
    B = prefix_lens.shape[0]
    block_d = max(16, triton.next_power_of_2(D))
    block_h, hb = decode_head_block(G)
    part = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    stage1, stage2 = decode_grids(B, H, KVH, num_splits)
    assert max(stage1[1:] + stage2[1:]) <= GRID_YZ_MAX and B <= GRID_X_MAX
    _decode_split[stage1](
        q, k_pool, v_pool, part, lse, req_to_token, req_rows, prefix_lens,
        req_to_token.stride(0), q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        scale, k_scale, v_scale, window or 0, num_splits,
        G=G, HB=hb, D=D, BLOCK_D=block_d, BLOCK_H=block_h,
        BLOCK_N=64 if D <= 128 else 32, IEEE=q.dtype == torch.float32)
    _decode_reduce[stage2](
        part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), num_splits,
        D=D, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)))
