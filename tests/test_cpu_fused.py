"""The fused CPU layers (layers/cpu_fused.c) against the eager torch ops they replace, on the
layouts the models hand them (views of wider rows), and when they run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import activation, cpu_fused
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary


@pytest.fixture
def norm():
    n = RMSNorm(96, 1e-5)
    n.weight.data = torch.randn(96, generator=torch.Generator().manual_seed(3))
    return n


def test_rms_norm_and_the_residual_add(norm):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 128, generator=gen)[:, :96]  # rows 128 floats apart
    res = torch.randn(37, 96, generator=gen)
    torch.testing.assert_close(norm(x), norm.eager(x), atol=2e-6, rtol=1e-6)
    out, h = norm.add_forward(x, res)
    assert torch.equal(h, res + x)  # the add rounds as torch's
    torch.testing.assert_close(out, norm.eager(res + x), atol=2e-6, rtol=1e-6)


def test_silu_mul_of_a_split_row():
    gate_up = torch.randn(19, 2 * 100, generator=torch.Generator().manual_seed(1)) * 8
    gate, up = gate_up[:, :100], gate_up[:, 100:]
    torch.testing.assert_close(activation.silu_mul(gate, up), F.silu(gate) * up,
                               atol=1e-6, rtol=1e-6)


def test_rotary_of_q_and_k_side_by_side_is_bitwise_torch():
    rot = RotaryEmbedding(64, 512, 10000.0)
    cos, sin = rot(torch.arange(23) * 7, torch.float32)
    qkv = torch.randn(23, 12 * 64 + 3 * 64, generator=torch.Generator().manual_seed(2))
    x = qkv[:, : 12 * 64].view(23, 12, 64)
    assert cpu_fused.rotary_ok(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    assert torch.equal(apply_rotary(x, cos, sin), x * cos + torch.cat((x2, x1), dim=-1) * sin)


def test_layouts_it_does_not_take_run_the_eager_ops(norm, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_fused, "rms_norm", lambda *a: calls.append(a))
    norm(torch.randn(4, 96, dtype=torch.bfloat16))  # not float32
    norm(torch.randn(4, 192)[:, ::2])  # a strided row
    assert not calls
    norm(torch.randn(4, 96))
    assert len(calls) == 1


def test_engine_norm_kernel_torch_turns_them_off(norm, monkeypatch):
    assert activation.cpu_ops() is cpu_fused
    monkeypatch.setenv(activation.NORM_KERNEL_ENV, "torch")
    assert activation.cpu_ops() is None
    x = torch.randn(5, 96)
    assert torch.equal(norm(x), norm.eager(x))


def test_a_library_that_cannot_build_is_said_once(monkeypatch, caplog, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_fused, "SOURCE", broken)
    monkeypatch.delitem(activation._loaded, "CPU", raising=False)  # loaded again, and failing
    cpu_fused.load.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="engine"):
            assert activation.cpu_ops() is None and activation.cpu_ops() is None
    finally:
        cpu_fused.load.cache_clear()
    assert caplog.text.count("their C loops did not load") == 1
