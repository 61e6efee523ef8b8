"""Weight-only GGUF block kernels (``*_q4_1_f32``, ``*_q4_0_f32``, ``*_q8_0_f32``): the same
packed bytes as the int8-activation kernels, float32 activations, the blocks dequantized in
registers. Their result must be float32 ``x @ unpack(W).T`` (+ bias) within float summation
rounding: ``|y - ref| <= TOL * (sum_k |x_k| |w_k| + |bias|)`` with ``TOL = 1e-5`` (float32's
epsilon is 6e-8; the kernels sum per block of 32 and scale by d, for Q4_1 adding
``m * sum(x)`` per block, so a term's rounding is bounded by ``|x| (|d q| + |m|)``, a few times
``|x||w|``: 1e-5 leaves a wide margin at K <= 1536 and still catches any wrong weight, which
moves the result by about ``|x||w| / sqrt(K)``). bfloat16 outputs: one bfloat16 rounding more."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from engine_cpu_kernels import kernel as K  # noqa: E402
from engine_cpu_kernels import ops  # noqa: E402
from gguf_blocks_helpers import QTYPES, dequantized, gguf_bytes  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

try:
    FEATURES = K.features()
except K.KernelUnavailable as e:  # no compiler, not x86
    pytest.skip(f"the kernels cannot run here: {e}", allow_module_level=True)

TOL = 1e-5
ROWS = [1, 2, 3, 4, 5, 16, 64, 65]  # fused (1..6 on AVX-512, 1..2 on AVX2), tile, two chunks
SHAPES = [(33, 160), (576, 576), (1536, 96)]  # (N, K): odd N / a partial tile, SmolLM2's, many


def isa_reason(isa: int) -> str | None:
    """None when the weight-only kernels run on ``isa`` here (no VNNI needed), else why not;
    ENGINE_CPU_ISA caps them as it caps the engine's pick."""
    cap = K.isa_cap()
    if isa > cap:
        return f"{K.ISA_ENV} caps the kernels to {ops.ISA_LABEL[cap]}"
    if isa == K.ISA_AVX2 and not FEATURES & K.FEAT_AVX2:
        return "this CPU has no AVX2"
    if isa == K.ISA_AVX512 and not FEATURES & K.FEAT_AVX512:
        return "this CPU has no AVX-512F/BW/VL"
    return None


ISAS = [pytest.param(isa, id=ops.ISA_LABEL[isa])
        for isa in (K.ISA_SCALAR, K.ISA_AVX2, K.ISA_AVX512)]




def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias, out_dtype) -> None:
    """y against float64 x @ w.T + bias within TOL of the terms' magnitudes (see the module)."""
    assert y.dtype == out_dtype and y.shape == (x.shape[0], w.shape[0])
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T + (0 if bias is None else bias.double())
    scale = xd.abs() @ wd.abs().T + (0 if bias is None else bias.double().abs())
    err = (y.double() - ref).abs()
    if out_dtype == torch.bfloat16:
        err = (err - ref.abs() * 2 ** -8).clamp(min=0)
    worst = (err / (scale + 1e-30)).max().item()
    assert worst <= TOL, worst


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_weight_only_equals_the_dequantized_product(qtype, isa):
    """Every format x instruction set x M in ROWS x N odd / even x bias / none x float32 /
    bfloat16 activations: float32 x @ unpack(W).T within float rounding."""
    reason = isa_reason(isa)
    if reason:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(11 + isa)
    for n, k in SHAPES:
        w0 = torch.randn(n, k, generator=gen) * 0.05
        raw = ops.quantize_gguf(w0, qtype)
        packed = ops.pack_gguf_blocks(raw, qtype, n, k)
        w = ops.unpack(packed)
        bias = torch.randn(n, generator=gen)
        for m in ROWS:
            if isa == K.ISA_SCALAR and n * k * m > 2e6:
                continue  # the scalar path is slow; the small shapes cover it
            x = torch.randn(m, k, generator=gen)
            for b in (None, bias):
                for dtype in (torch.float32, torch.bfloat16):
                    xd = x.to(dtype)
                    y = ops.linear(xd, packed, b, isa, weight_only=True)
                    check(y, xd.float(), w, b, dtype)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_extreme_blocks_and_strided_rows(qtype):
    """Every nibble / int8 value, zero blocks, large and negative m, a strided x on two
    threads: each path (fused and tile, every instruction set) within float rounding."""
    torch.set_num_threads(2)  # the fixture restores it
    gen = torch.Generator().manual_seed(12)
    n, k = 70, 128
    w0 = torch.randn(n, k, generator=gen) * 0.05
    w0[0, :32] = 0  # a zero block
    w0[1] = torch.linspace(-3, 5, k)  # every step value, big m
    w0[2, 32:64] = torch.arange(32).float() - 40  # all negative
    raw = ops.quantize_gguf(w0, qtype)
    packed = ops.pack_gguf_blocks(raw, qtype, n, k)
    w = ops.unpack(packed)
    for m in (1, 3, 7, 20):
        x = torch.randn(m, 2, k, generator=gen)[:, 1]  # rows 2k apart
        for isa in (K.ISA_SCALAR, K.ISA_AVX2, K.ISA_AVX512):
            if isa_reason(isa) is None:
                check(ops.linear(x, packed, None, isa, weight_only=True), x, w, None,
                      torch.float32)


def test_same_packing_for_both_modes():
    """One packed weight runs both modes: pack / pack_blocks of an f32 kernel give the bytes the
    int8 kernel's give; the int8 mode differs from the weight-only one by its activation
    rounding; float formats refuse weight-only."""
    by_name = {k.name: k for k in ops.KERNELS}
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(40, 96, generator=gen) * 0.05
    x = torch.randn(3, 96, generator=gen)
    for qtype in ("q4_0", "q4_1", "q8_0"):
        f32, int8 = by_name[f"avx2_{qtype}_f32"], by_name[f"avx2_{qtype}"]
        assert f32.weight_only and not int8.weight_only and f32.fmt == int8.fmt
        raw = gguf_bytes(w, qtype)
        p = f32.pack_blocks(raw, qtype, 40, 96)
        assert torch.equal(p.data, int8.pack_blocks(raw, qtype, 40, 96).data)
        assert torch.equal(f32.pack(w).data, int8.pack(w).data)
        wq = ops.unpack(p)
        y_wo = ops.linear(x, p, None, K.ISA_SCALAR, weight_only=True)
        y_i8 = ops.linear(x, p, None, K.ISA_SCALAR)
        check(y_wo, x, wq, None, torch.float32)
        assert (y_i8 - x @ wq.T).abs().max() > 10 * (y_wo - x @ wq.T).abs().max()
    f16 = ops.pack(w, K.FMT_F16)
    with pytest.raises(ValueError, match="weight-only runs the block formats"):
        ops.linear(x, f16, weight_only=True)


def test_the_default_models_tensors():
    """The real file's bytes (SmolLM2-135M-Instruct: blk.0.attn_q.weight Q4_1, the first 512
    rows of token_embd.weight Q8_0) through every weight-only kernel usable here: x @ gguf-py's
    dequantized values within float rounding."""
    from engine.models.default import default_model_path

    try:
        path = default_model_path()
    except Exception as e:  # noqa: BLE001 - the model package is optional
        pytest.skip(f"no default model here: {e}")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    gen = torch.Generator().manual_seed(14)
    ran = 0  # kernels usable here (none with ENGINE_CPU_ISA=scalar: then the scalar path)
    for name, qtype, rows in (("blk.0.attn_q.weight", "q4_1", None),
                              ("token_embd.weight", "q8_0", 512)):
        t = tensors[name]
        assert t.tensor_type == QTYPES[qtype]
        data = np.asarray(t.data)
        n, k = data.shape[0], int(t.shape[0])
        if rows:
            data, n = data[:rows], rows
        raw = torch.from_numpy(np.array(data))
        w = dequantized(raw, qtype, n, k)
        for kernel in ops.KERNELS:
            if (kernel.weight_dtype != qtype or not kernel.weight_only
                    or kernel.unavailable_reason()):
                continue
            packed = kernel.pack_blocks(raw, qtype, n, k)
            assert torch.equal(ops.unpack(packed), w)
            for m in (1, 5, 16):
                x = torch.randn(m, k, generator=gen)
                check(kernel.linear(x, packed), x, w, None, torch.float32)
            ran += 1
        if not any(kr.weight_dtype == qtype and kr.weight_only and not kr.unavailable_reason()
                   for kr in ops.KERNELS):
            packed = ops.pack_gguf_blocks(raw, qtype, n, k)
            x = torch.randn(2, k, generator=gen)
            check(ops.linear(x, packed, None, K.ISA_SCALAR, weight_only=True), x, w, None,
                  torch.float32)
    assert ran >= 2 or K.isa_cap() == K.ISA_SCALAR


def test_weight_only_kernels_are_the_default_pick(registries, monkeypatch):
    """For q4_1 / q4_0 / q8_0 the engine picks the weight-only kernel (AVX-512 when this CPU has
    AVX-512F/BW/VL, else AVX2); the int8 ones stay registered by name; ENGINE_CPU_ISA=avx2
    gives the AVX2 weight-only one."""
    from engine.registry import resolve_linear_kernel

    monkeypatch.delenv(K.ISA_ENV, raising=False)
    entries = {e.name: e for e in registries.linear_kernels}
    cpu = torch.device("cpu")
    best = "avx512" if FEATURES & K.FEAT_AVX512 else "avx2"
    for qtype in ("q4_1", "q4_0", "q8_0"):
        assert entries[f"avx512_{qtype}_f32"].extra["weight_dtype"] == qtype
        assert entries[f"avx2_{qtype}_f32"].extra["weight_dtype"] == qtype
        for isa in ("avx512", "avx2"):
            assert (entries[f"{isa}_{qtype}_f32"].extra["priority"]
                    > entries[f"avx512_{qtype}"].extra["priority"])
        assert resolve_linear_kernel(registries, qtype, cpu).name == f"{best}_{qtype}_f32"
    monkeypatch.setenv(K.ISA_ENV, "avx2")
    assert resolve_linear_kernel(registries, "q4_1", cpu).name == "avx2_q4_1_f32"
