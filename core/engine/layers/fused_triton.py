"""The small layers as one Triton kernel each: RMSNorm, the residual add with the RMSNorm after
it, SiLU-and-mul and the rotary embedding: the GPU path of layers/norm.py's ``RMSNorm`` (and
its ``add_forward``), layers/activation.py's ``silu_mul`` and layers/rotary.py's
``apply_rotary`` (imported only where they run: CUDA with triton, or Triton's CPU interpreter,
``TRITON_INTERPRET=1``, in the tests).

Why: in eager PyTorch a bfloat16 RMSNorm is eight kernels (cast, square, mean, add eps, rsqrt,
scale, cast back, weight) and SiLU-and-mul two; on a GPU a batch-1 decode step of a 32-layer
model spent ~1.8 ms of its 5.6 ms of device time in such kernels of 1-3 us each (H200, Llama-3-8B
shapes, scripts/gpu_throughput.py --profile); the residual add is one more, the rotation four
(two products, a concatenation, a sum). SGLang and vLLM fuse them (sgl-kernel's
``rmsnorm``/``fused_add_rmsnorm``/``silu_and_mul``/``apply_rope_with_cos_sin_cache_inplace``,
vLLM's custom ops of the same names).

The arithmetic is the eager path's, rounding included: the row's mean square in float32, the
normalized row rounded to the input dtype *before* the weight multiplies (the order HF
checkpoints expect), the product rounded once to the output dtype (torch's result type of
weight and input); SiLU in float32 rounded to the input dtype, then the product with ``up``
rounded once; the residual sum rounded to its dtype before the norm reads it; the rotation's
two products each rounded, then their sum. Only the float32 sum's order differs from torch's
reduction (and, in float32, a fused multiply-add where the compiler makes one)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(X, R, W, Y, H, stride_x, stride_r, stride_y, stride_h, N, eps,
              ADD: tl.constexpr, BLOCK: tl.constexpr):
    """RMSNorm of a row of X, or (ADD) of X + R, that sum stored into H first."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(H.dtype.element_ty)  # the residual stream, rounded as torch's add rounds
        tl.store(H + row * stride_h + offs, h, mask=mask)
        x = h.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / N
    y = x * (1.0 / tl.sqrt(mean_sq + eps))
    if ADD:  # rounded to the normed input's dtype first
        y = y.to(H.dtype.element_ty).to(tl.float32)
    else:
        y = y.to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (y * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rotary(X, C, S, Y, stride_xt, stride_xh, stride_c, stride_yt, stride_yh, heads,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < heads)[:, None] & (d < 2 * HALF)[None, :]
    rot = tl.where(d < HALF, d + HALF, d - HALF)  # (x2, x1): the sign is in sin's first half
    row = X + t * stride_xt + h[:, None] * stride_xh
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(row + rot[None, :], mask=mask, other=0.0).to(tl.float32)
    dmask = d < 2 * HALF
    c = tl.load(C + t * stride_c + d, mask=dmask, other=0.0).to(tl.float32)
    s = tl.load(S + t * stride_c + d, mask=dmask, other=0.0).to(tl.float32)
    dtype = Y.dtype.element_ty
    a = (x * c[None, :]).to(dtype).to(tl.float32)
    b = (xr * s[None, :]).to(dtype).to(tl.float32)
    tl.store(Y + t * stride_yt + h[:, None] * stride_yh + d[None, :], (a + b).to(dtype),
             mask=mask)


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
        _rms_norm[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0,
                                  n, eps, ADD=False, BLOCK=triton.next_power_of_2(n),
                                  num_warps=_warps(n))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of ``residual + x``, ``residual + x``) over [rows, N] tensors whose last
    dimension is contiguous: one program per row."""
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n), residual.reshape(-1, n)
    h = torch.empty(x2.shape, dtype=torch.result_type(x, residual), device=x.device)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, h), device=x.device)
    if x2.shape[0]:
        _rms_norm[(x2.shape[0],)](x2, r2, weight, out, h, x2.stride(0), r2.stride(0),
                                  out.stride(0), h.stride(0), n, eps, ADD=True,
                                  BLOCK=triton.next_power_of_2(n), num_warps=_warps(n))
    return out.view(x.shape), h.view(x.shape)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """layers/rotary.py's ``apply_rotary`` of x [T, heads, D] (heads strided, D contiguous)
    with cos/sin [T, 1, D] (contiguous, x's dtype): a new [T, heads, D]."""
    t, heads, d = x.shape
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if t and heads:
        block_d = triton.next_power_of_2(d)
        block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_d))
        _rotary[(t, triton.cdiv(heads, block_h))](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), out.stride(0),
            out.stride(1), heads, HALF=d // 2, BLOCK_H=block_h, BLOCK_D=block_d,
            num_warps=_warps(block_h * block_d))
    return out


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
