"""The fused mixture-of-experts kernel in Triton (the GPU path of layers/moe.py's
``SparseMoE``; imported only where it runs: CUDA with triton, or Triton's CPU interpreter,
``TRITON_INTERPRET=1``, in the tests).

The design SGLang and vLLM use: the (token, expert) pairs sorted by expert and padded per
expert to the row block (layers/moe_align.py), then one grouped GEMM launch over every
expert's blocks: a program owns a block of ``BLOCK_M`` sorted pairs (all one expert's) and
``BLOCK_N`` output columns, gathers its A rows through the pair ids (token ``pair // k`` for the
first GEMM, the pair's own row for the second), multiplies them by that expert's weight
(``[E, N, K]``: the experts' ``[out, in]`` weights stacked) with float32 accumulation and
writes the rows back at the pairs' places in a ``[T * k, N]`` output, so nothing is put back
in token order. It runs twice: gate_up (``[E, 2I, H]``), SiLU-and-mul, down (``[E, H, I]``)
with each pair's top-k routing weight multiplied in the kernel before the store (float32);
the k rows of a token are then summed. A block whose expert is -1 (another rank's) writes
zeros. Every size of the launch is an upper bound on the host (no sync, no per-expert loop).

Operands: float16/bfloat16 weights multiply in their dtype (the activations cast to it) with
float32 accumulation; float32 asks for ``input_precision="ieee"`` (a GPU's default for float32
``tl.dot`` is TF32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.layers.moe_align import BlockLayout, moe_align_block_size


@triton.jit
def _grouped_gemm(A, B, C, W, sorted_pairs, block_experts, N, K, num_pairs, num_nblocks,
                  stride_am, stride_be, stride_bn, stride_cm, A_DIV: tl.constexpr,
                  MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    mblk = pid // num_nblocks
    nblk = pid % num_nblocks
    pairs = tl.load(sorted_pairs + mblk * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    offs_n = nblk * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    c_ptrs = C + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    c_mask = valid[:, None] & n_mask[None, :]
    expert = tl.load(block_experts + mblk)
    if expert < 0:  # another rank's expert (or past the last run: no valid row)
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=C.dtype.element_ty), mask=c_mask)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        rows = (pairs // A_DIV).to(tl.int64)
        a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = (B + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn
                  + offs_k[:, None])
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a.to(b.dtype), b)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if MUL_WEIGHT:
            w = tl.load(W + pairs, mask=valid, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 while an expert averages few pairs (decode), else 64."""
    return 16 if num_pairs <= 4 * num_experts else 64


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, layout: BlockLayout,
                 bm: int, a_div: int, routing: torch.Tensor | None = None) -> torch.Tensor:
    """``out[p] = a[p // a_div] @ w[expert(p)].T`` (times ``routing[p]`` if given) for every
    pair ``p`` of ``layout``; ``w`` [E, N, K] contiguous, ``a`` [rows, K], ``out`` [pairs, N]."""
    n, k = w.shape[1], w.shape[2]
    bn, bk = _block(n, 64), _block(k, 64)
    num_nblocks = triton.cdiv(n, bn)
    grid = (layout.block_experts.numel() * num_nblocks,)
    _grouped_gemm[grid](a, w, out, routing if routing is not None else out,
                        layout.sorted_pairs, layout.block_experts, n, k, layout.num_pairs,
                        num_nblocks, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                        A_DIV=a_div, MUL_WEIGHT=routing is not None,
                        IEEE=w.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, num_experts: int,
              local: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' weighted sum [T, hidden] in float32: ``x`` [T, H], ``w13``
    [E', 2I, H] (gate rows, then up rows), ``w2`` [E', H, I], the routing ``weights`` and
    expert ``ids`` [T, k]; ``local`` [E]: each global expert's index in ``w13``/``w2``, -1 for
    one this rank does not hold (None: E' = E, every expert here)."""
    t, k = ids.shape
    num_pairs = t * k
    x = x.to(w13.dtype).contiguous()
    bm = block_m(num_pairs, num_experts)
    layout = moe_align_block_size(ids, num_experts, bm, local)
    gate_up = grouped_gemm(x, w13, x.new_empty((num_pairs, w13.shape[1])), layout, bm, k)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate).mul_(up)
    down = grouped_gemm(act, w2, x.new_empty((num_pairs, w2.shape[1]), dtype=torch.float32),
                        layout, bm, 1, weights.reshape(-1).contiguous())
    return down.view(t, k, -1).sum(dim=1)
