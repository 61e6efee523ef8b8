"""RMSNorm and SiLU-and-mul as one Triton kernel each: the GPU path of layers/norm.py's
``RMSNorm`` and layers/activation.py's ``silu_mul`` (imported only where they run: CUDA with
triton, or Triton's CPU interpreter, ``TRITON_INTERPRET=1``, in the tests).

Why: in eager PyTorch a bfloat16 RMSNorm is eight kernels (cast, square, mean, add eps, rsqrt,
scale, cast back, weight) and SiLU-and-mul two; on a GPU a batch-1 decode step of a 32-layer
model spent ~1.8 ms of its 5.6 ms of device time in such kernels of 1-3 us each (H200, Llama-3-8B
shapes, scripts/gpu_throughput.py --profile). SGLang and vLLM fuse both (sgl-kernel's
``rmsnorm``/``silu_and_mul``, vLLM's ``rms_norm``/``silu_and_mul`` custom ops).

The arithmetic is the eager path's, rounding included: the row's mean square in float32, the
normalized row rounded to the input dtype *before* the weight multiplies (the order HF
checkpoints expect), the product rounded once to the output dtype (torch's result type of
weight and input); SiLU in float32 rounded to the input dtype, then the product with ``up``
rounded once. Only the float32 sum's order differs from torch's reduction."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(X, W, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / N
    y = x * (1.0 / tl.sqrt(mean_sq + eps))
    y = y.to(X.dtype.element_ty).to(tl.float32)  # rounded to the input dtype first
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (y * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul(G, U, Y, stride_g, stride_u, stride_y, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    g = tl.load(G + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + col, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + col, (s * u).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (its rows may be strided, its last dimension
    contiguous): one program per row."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x2.shape[0]:
        _rms_norm[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n, eps,
                                  BLOCK=triton.next_power_of_2(n), num_warps=_warps(n))
    return out.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for two [M, N] views with contiguous rows (a merged gate_up
    projection's halves)."""
    m, n = gate.shape
    out = torch.empty((m, n), dtype=torch.result_type(gate, up), device=gate.device)
    if m:
        block = min(triton.next_power_of_2(n), 2048)
        _silu_mul[(m, triton.cdiv(n, block))](gate, up, out, gate.stride(0), up.stride(0),
                                               out.stride(0), n, BLOCK=block,
                                               num_warps=_warps(block))
    return out


def _warps(n: int) -> int:
    return 16 if n >= 8192 else 8 if n >= 2048 else 4 if n >= 512 else 1
