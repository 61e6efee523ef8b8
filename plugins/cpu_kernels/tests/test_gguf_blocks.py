"""GGUF blocks run as they are: Q4_0 / Q4_1 / Q8_0 tensors packed from the file's bytes
(``ops.pack_gguf_blocks``, ``CPUGemm.pack_blocks``) and multiplied by every instruction set this
CPU has, against torch on the blocks' values (gguf-py's dequantizer) and the activations
quantized per block of 32 as the kernels quantize them."""

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



def isa_reason(isa: int) -> str | None:
    """None when the block kernels run on ``isa`` here, else why not."""
    if isa == K.ISA_AVX2 and not FEATURES & K.FEAT_AVX2:
        return "this CPU has no AVX2"
    if isa == K.ISA_AVX512 and not (FEATURES & K.FEAT_AVX512 and FEATURES & K.FEAT_AVX512_VNNI):
        return "this CPU has no AVX-512 with AVX512_VNNI"
    return None


ISAS = [pytest.param(isa, id=ops.ISA_LABEL[isa])
        for isa in (K.ISA_SCALAR, K.ISA_AVX2, K.ISA_AVX512)]




def q4_1_mins(raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """|m| of each Q4_1 block, expanded to [n, k]."""
    m = raw.reshape(n, k // 32, 20)[..., 2:4].contiguous().view(torch.float16).float()
    return m.abs().repeat_interleave(32, -1).reshape(n, k)


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the kernels quantize it, in float32 as the C code computes it: per block of 32,
    d = max|x| / 127, q = round(x * (1 / d)) halves away from zero. Returns (q * d, the block
    maxima expanded to x's shape)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    s = blocks * inv
    q = s.sign() * (s.abs() + 0.5).floor()
    return (q * d).reshape(m, k), amax.expand_as(blocks).reshape(m, k)


def check_against_references(y, x, w, raw, qtype, bias, out_dtype):
    """``y`` (the kernel's) against (1) float64 torch on the dequantized blocks and the
    activations quantized as the kernel does: within float32 rounding, 2e-6 of the sum of the
    terms' magnitudes (for Q4_1 the kernel adds d*q and m separately, so |d*q| + |m| bounds a
    term); bfloat16 outputs within one bfloat16 rounding more; and (2) plain float32
    x @ W.T: within the activation rounding bound, sum_k |W[n, k]| * max|x block| / 254, and
    within 2% relative (Frobenius) error."""
    n, k = w.shape
    b64 = 0 if bias is None else bias.double()
    xq, amax = quantized_activations(x)
    ref = xq.double() @ w.double().T + b64
    wmag = w.abs() + (q4_1_mins(raw, n, k) if qtype == "q4_1" else 0)
    scale = xq.double().abs() @ wmag.double().T + (0 if bias is None else bias.double().abs())
    yd = y.double()
    assert y.dtype == out_dtype and y.shape == (x.shape[0], n)
    if out_dtype == torch.float32:
        err = ((yd - ref).abs() / (scale + 1e-30)).max().item()
        assert err < 2e-6, err
    else:
        assert ((yd - ref).abs() <= ref.abs() * 2 ** -8 + scale * 2e-6).all()
    plain = x.double() @ w.double().T + b64
    bound = (amax.double() / 254) @ w.double().abs().T
    slack = plain.abs() * (2 ** -8 if out_dtype == torch.bfloat16 else 1e-5) + scale * 1e-5
    assert ((yd - plain).abs() <= bound + slack).all()
    assert (yd - plain).norm() <= 0.02 * plain.norm()


SHAPES = [(33, 160), (576, 576), (1536, 96)]  # (N, K): a partial tile; SmolLM2's; many tiles


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ["q4_0", "q4_1"])
@pytest.mark.parametrize("m", [1, 2, 3, 16, 64, 65])
def test_q4_kernels_match_the_blocks(qtype, isa, m):
    """Every Q4 path at 1, 2, 3, 16, 64 and 65 rows (the AVX-512 micro-kernel's 6 rows and each
    remainder, two row chunks of 64), N with a partial tile and many tiles, float32 and
    bfloat16 activations, with and without bias."""
    reason = isa_reason(isa)
    if reason:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(m * 7 + (qtype == "q4_1"))
    for n, k in SHAPES:
        if isa == K.ISA_SCALAR and n * k * m > 3e6:
            continue  # the scalar reference is slow; its small shapes cover it
        w0 = torch.randn(n, k, generator=gen) * 0.05
        raw = gguf_bytes(w0, qtype)
        packed = ops.pack_gguf_blocks(raw, qtype, n, k)
        w = dequantized(raw, qtype, n, k)
        assert torch.equal(ops.unpack(packed), w)
        x = torch.randn(m, k, generator=gen)
        for bias in (None, torch.randn(n, generator=gen)):
            for dtype in (torch.float32, torch.bfloat16):
                xd = x.to(dtype)
                y = ops.linear(xd, packed, bias, isa)
                check_against_references(y, xd.float(), w, raw, qtype, bias, dtype)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_all_paths_agree_on_two_threads(qtype):
    """The N tiles split over two OpenMP threads, strided bfloat16 rows: every instruction set
    gives the scalar reference's result within float32 rounding."""
    torch.set_num_threads(2)  # the fixture restores it
    gen = torch.Generator().manual_seed(5)
    n, k = 200, 256
    raw = gguf_bytes(torch.randn(n, k, generator=gen) * 0.05, qtype)
    packed = ops.pack_gguf_blocks(raw, qtype, n, k)
    x = torch.randn(7, 2, k, generator=gen)[:, 0]  # rows 2k apart
    w = dequantized(raw, qtype, n, k)
    ys = {isa: ops.linear(x, packed, None, isa) for isa in (K.ISA_SCALAR, K.ISA_AVX2,
                                                            K.ISA_AVX512)
          if isa_reason(isa) is None}
    for isa, y in ys.items():
        check_against_references(y, x, w, raw, qtype, None, torch.float32)
        assert torch.allclose(y, ys[K.ISA_SCALAR], rtol=1e-5, atol=1e-5), isa


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_activation_ties_round_away_from_zero(qtype, isa):
    """Activations exactly halfway between two int8 steps (block max 127: the scale is 1)
    round away from zero on every path, as the scalar roundf does (the SIMD quantizer
    reproduces it): the result equals the reference exactly rounded that way."""
    reason = isa_reason(isa)
    if reason:
        pytest.skip(reason)
    ties = torch.tensor([127.0] + [(i % 9 - 4) + 0.5 for i in range(31)])
    x = torch.stack([ties, -ties, ties.roll(5)]).repeat(1, 3)  # k = 96
    gen = torch.Generator().manual_seed(8)
    w0 = torch.randn(40, 96, generator=gen) * 0.05
    raw = gguf_bytes(w0, qtype)
    packed = ops.pack_gguf_blocks(raw, qtype, 40, 96)
    w = dequantized(raw, qtype, 40, 96)
    xq, _ = quantized_activations(x)
    assert torch.equal(xq, x.sign() * (x.abs() + 0.5).floor())  # the reference: away from 0
    check_against_references(ops.linear(x, packed, None, isa), x, w, raw, qtype, None,
                             torch.float32)


def test_quantizers_make_the_bytes_gguf_makes():
    """ops.quantize_q4_0 / q4_1 (torch; what CPUGemm.pack does with a float weight) write the
    bytes gguf-py's (llama.cpp's reference) quantizers write, ties and zero blocks included."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 128, generator=gen) * 0.05
    w[0, :32] = 0  # a zero block
    w[1, 32:64] = torch.linspace(-1, 1, 32)
    w[2, :32] = torch.randint(-4, 5, (32,), generator=gen).float() / 8
    assert torch.equal(ops.quantize_q4_0(w), gguf_bytes(w, "q4_0").reshape(40, -1))
    assert torch.equal(ops.quantize_q4_1(w), gguf_bytes(w, "q4_1").reshape(40, -1))
    for fmt, qtype in ((K.FMT_Q4_0, "q4_0"), (K.FMT_Q4_1, "q4_1")):
        assert torch.equal(ops.pack(w, fmt).data,
                           ops.pack_gguf_blocks(gguf_bytes(w, qtype), qtype, 40, 128).data)


def test_q8_0_blocks_pack_as_the_existing_format():
    """GGUF Q8_0 bytes give exactly the FMT_Q8_0 packing of their values (the existing Q8_0
    kernels run them)."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(70, 96, generator=gen) * 0.05
    raw = gguf_bytes(w, "q8_0")
    packed = ops.pack_gguf_blocks(raw, "q8_0", 70, 96)
    q, d = ops.quantize_q8_0(w)
    assert packed.fmt == K.FMT_Q8_0
    assert torch.equal(packed.data, ops.pack_q8_0_blocks(q, d).data)
    assert torch.equal(ops.unpack(packed), dequantized(raw, "q8_0", 70, 96))


def test_the_default_models_tensors():
    """The bytes of the real file (SmolLM2-135M-Instruct, Q4_1 linears, Q8_0 embeddings):
    packed as they are, the kernels multiply by gguf-py's dequantized values."""
    from engine.models.default import default_model_path

    try:
        path = default_model_path()
    except Exception as e:  # noqa: BLE001 - the model package is optional
        pytest.skip(f"no default model here: {e}")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    for name, qtype, rows in (("blk.0.attn_q.weight", "q4_1", None),
                              ("token_embd.weight", "q8_0", 512)):
        t = tensors[name]
        assert t.tensor_type == QTYPES[qtype]
        data = np.asarray(t.data)
        n, k = data.shape[0], int(t.shape[0])
        if rows:  # a slice of the 49152 rows keeps the test fast; rows are whole blocks
            data, n = data[:rows], rows
        raw = torch.from_numpy(np.array(data))  # a copy: the reader maps the file read-only
        w = dequantized(raw, qtype, n, k)
        gen = torch.Generator().manual_seed(6)
        x = torch.randn(2, k, generator=gen)
        for kernel in ops.KERNELS:
            if kernel.weight_dtype != qtype or kernel.weight_only or kernel.unavailable_reason():
                continue  # the weight-only kernels: tests/test_weight_only.py
            packed = kernel.pack_blocks(raw, qtype, n, k)
            assert (packed.n, packed.k) == (n, k)
            assert torch.equal(ops.unpack(packed), w)
            check_against_references(kernel.linear(x, packed), x, w, raw, qtype, None,
                                     torch.float32)


def test_bad_blocks_are_refused_with_a_reason():
    raw = torch.zeros(10 * 3 * 20, dtype=torch.uint8)
    assert ops.pack_gguf_blocks(raw, "q4_1", 10, 96).n == 10
    with pytest.raises(ValueError, match="unknown GGUF block type 'q5_0'"):
        ops.pack_gguf_blocks(raw, "q5_0", 10, 96)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.pack_gguf_blocks(raw, "q4_1", 10, 80)
    with pytest.raises(ValueError, match=r"a 10 x 96 q4_0 tensor is 540 bytes .* got 600"):
        ops.pack_gguf_blocks(raw, "q4_0", 10, 96)
    with pytest.raises(ValueError, match="uint8"):
        ops.pack_gguf_blocks(raw.view(torch.int8), "q4_1", 10, 96)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.pack(torch.randn(8, 48), K.FMT_Q4_0)
    q41 = next(k for k in ops.KERNELS if k.name == "avx2_q4_1")
    with pytest.raises(ValueError, match="runs q4_1 blocks, not 'q4_0'"):
        q41.pack_blocks(raw, "q4_0", 10, 96)


def test_q4_kernels_registered_and_picked_per_cpu(registries, monkeypatch):
    """q4_0 / q4_1 int8-activation kernels per instruction set, the AVX-512 (VNNI) one first
    among them; ENGINE_CPU_ISA=avx2 caps them to the AVX2 one. (The engine's default pick is the
    weight-only kernel: tests/test_weight_only.py; here the int8 ones compete alone.)"""
    from engine.registry import resolve_linear_kernel

    monkeypatch.delenv(K.ISA_ENV, raising=False)  # the run's own cap (an ENGINE_CPU_ISA=avx2 run)

    names = {e.name: e.extra["weight_dtype"] for e in registries.linear_kernels}
    assert names["avx2_q4_1"] == names["avx512_q4_1"] == "q4_1"
    assert names["avx2_q4_0"] == names["avx512_q4_0"] == "q4_0"
    for e in [e for e in registries.linear_kernels if e.name.endswith("_f32")]:
        monkeypatch.delitem(registries.linear_kernels._entries, e.name)  # restored after
    cpu = torch.device("cpu")
    best = "avx512" if isa_reason(K.ISA_AVX512) is None else "avx2"
    assert resolve_linear_kernel(registries, "q4_1", cpu).name == f"{best}_q4_1"
    assert resolve_linear_kernel(registries, "q4_0", cpu).name == f"{best}_q4_0"
    monkeypatch.setenv(K.ISA_ENV, "avx2")
    assert resolve_linear_kernel(registries, "q4_1", cpu).name == "avx2_q4_1"
    assert resolve_linear_kernel(registries, "q4_0", cpu).name == "avx2_q4_0"
