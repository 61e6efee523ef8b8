"""The fused RMSNorm and SiLU-and-mul Triton kernels (layers/fused_triton.py) against the eager
ops they replace on a GPU (layers/norm.py's ``RMSNorm``, ``F.silu(gate) * up``), run on the CPU
under Triton's interpreter (TRITON_INTERPRET=1: float32 and float16 there); on a CUDA machine
the same cases run on the GPU, bfloat16 too, and the ``gpu`` test checks that the modules take
the kernels there and that ``ENGINE_NORM_KERNEL=torch`` turns them off."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine_testing.triton_device import triton_device

DEVICE = triton_device()  # before the kernels' module is imported (the interpreter)
GPU = DEVICE == "cuda"

from engine.layers import activation
from engine.layers.norm import RMSNorm
from engine.layers.fused_triton import add_rms_norm, rms_norm, rotary, silu_mul
from engine.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("single_torch_thread")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if GPU else [])


def eager_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps).to(x.device)
    norm.weight.data = weight
    os.environ[activation.NORM_KERNEL_ENV] = "torch"
    try:
        return norm(x)
    finally:
        del os.environ[activation.NORM_KERNEL_ENV]


# max ulps() apart: the kernels round where the eager ops round, but a float32 intermediate may
# differ in its last bits (the sum's order; exp and rsqrt from another library), which can move
# each of the two roundings after it by one step; float32 outputs carry those bits unrounded
# (measured on the CPU interpreter: <= 1.31 for float16, <= 2.74 for float32)
TOL = {torch.float32: 4.0, torch.float16: 2.0, torch.bfloat16: 2.0}


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units of b's dtype's resolution at b's magnitude (1 = one rounding)."""
    eps = torch.finfo(b.dtype).eps
    scale = b.float().abs().clamp_min(torch.finfo(b.dtype).tiny / eps) * eps
    return float(((a.float() - b.float()).abs() / scale).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (7, 4096), (3, 100), (0, 64)])
def test_rms_norm_matches_the_eager_ops(dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * 7 + n)
    x = (torch.randn(rows, n + 32, generator=gen) * 3)[:, 16:16 + n]  # strided rows
    w = torch.randn(n, generator=gen)
    x, w = x.to(DEVICE, dtype), w.to(DEVICE, dtype)
    got, want = rms_norm(x, w, 1e-5), eager_norm(x, w, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    if rows:
        assert ulps(got, want) <= TOL[dtype]


def test_rms_norm_of_heads_and_a_float32_weight():
    """q/k norm: [T, heads, head_dim] rows; a float32 weight over float16 rows gives float32
    (torch's result type), as the eager module does."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, 64, generator=gen).to(DEVICE, torch.float16)
    w = torch.randn(64, generator=gen).to(DEVICE)
    got, want = rms_norm(x, w, 1e-6), eager_norm(x, w, 1e-6)
    assert got.dtype == torch.float32 and got.shape == (5, 4, 64)
    assert ulps(got, want) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (9, 5000), (4, 17)])
def test_silu_mul_matches_the_eager_ops(dtype, rows, n):
    gen = torch.Generator().manual_seed(rows + n)
    merged = (torch.randn(rows, 2 * n, generator=gen) * 4).to(DEVICE, dtype)
    gate, up = merged[:, :n], merged[:, n:]  # a merged gate_up projection's halves
    got, want = silu_mul(gate, up), F.silu(gate) * up
    assert got.dtype == want.dtype and got.shape == want.shape
    assert ulps(got, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_the_eager_ops(dtype):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 4096 + 64, generator=gen) * 2)[:, :4096].to(DEVICE, dtype)  # strided
    r = (torch.randn(6, 4096, generator=gen) * 5).to(DEVICE, dtype)
    w = torch.randn(4096, generator=gen).to(DEVICE, dtype)
    got, got_h = add_rms_norm(x, r, w, 1e-5)
    want_h = r + x
    assert torch.equal(got_h, want_h)  # the residual stream: exactly torch's sum
    want = eager_norm(want_h, w, 1e-5)
    assert got.dtype == want.dtype and ulps(got, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(12, 64), (3, 128), (5, 96)])
def test_rotary_matches_the_eager_ops(dtype, heads, head_dim):
    """q and k side by side, viewed out of a wider qkv row (heads strided), as llama.py
    rotates them."""
    rope = RotaryEmbedding(head_dim, 512, 10000.0).to(DEVICE)
    t = 9
    gen = torch.Generator().manual_seed(heads * head_dim)
    qkv = torch.randn(t, (heads + 2) * head_dim, generator=gen).to(DEVICE, dtype)
    x = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    positions = torch.tensor([0, 1, 5, 77, 300, 511, 2, 3, 4], device=DEVICE)
    cos, sin = rope(positions, dtype)
    got = rotary(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    want = x * cos + torch.cat((x2, x1), dim=-1) * sin  # apply_rotary's eager ops
    assert got.dtype == want.dtype and ulps(got, want) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_the_modules_take_the_kernels_on_cuda(monkeypatch):
    assert activation.gpu_ops() is not None
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    norm = RMSNorm(256).to("cuda", torch.bfloat16)
    norm.weight.data.normal_()
    calls = []
    real = activation.gpu_ops().rms_norm
    monkeypatch.setattr(activation.gpu_ops(), "rms_norm",
                        lambda *a: calls.append(1) or real(*a))
    fused = norm(x)
    assert calls == [1]
    monkeypatch.setenv(activation.NORM_KERNEL_ENV, "torch")
    assert activation.gpu_ops() is None
    assert ulps(fused, norm(x)) <= TOL[torch.bfloat16] and calls == [1]
