"""The CPU GEMM kernels: every (weight format, instruction set) this CPU runs against torch on
the same rounded weights, how they are registered and picked per CPU, and the engine with
``--dtype float16`` / ``bfloat16`` through them against HF transformers and the core's kernels."""

from __future__ import annotations

import pytest
import torch

from engine.quality import prefill_logits
from engine.registry import BackendUnavailable, EngineError, resolve_linear_kernel
from engine.runner import ModelRunner
from engine_testing.generation import greedy_generate
from engine_testing.logits import compare_prompt_logits
from engine_testing.weights import hf_on_half_weights
from engine_cpu_kernels import kernel as K
from engine_cpu_kernels import ops

pytestmark = pytest.mark.usefixtures("single_torch_thread")

try:
    FEATURES = K.features()
except K.KernelUnavailable as e:  # no compiler, not x86
    pytest.skip(f"the kernels cannot run here: {e}", allow_module_level=True)

HAS = {
    K.ISA_SCALAR: True,
    K.ISA_AVX2: bool(FEATURES & K.FEAT_AVX2),
    K.ISA_AVX512: bool(FEATURES & K.FEAT_AVX512),
}


def reachable(fmt: int, isa: int) -> str | None:
    """None when the path runs on this CPU, else why not (the skip reason)."""
    if not HAS[isa]:
        return f"this CPU has no {ops.ISA_LABEL[isa]}"
    if fmt == K.FMT_BF16_PAIRS and isa == K.ISA_AVX2:
        return "vdpbf16ps has no AVX2 form"
    if fmt == K.FMT_BF16_PAIRS and isa == K.ISA_AVX512 and not FEATURES & K.FEAT_AVX512_BF16:
        return "this CPU has no AVX512_BF16"
    if fmt == K.FMT_Q8_0 and isa == K.ISA_AVX512 and not FEATURES & K.FEAT_AVX512_VNNI:
        return "this CPU has no AVX512_VNNI"
    return None


PATHS = [pytest.param(fmt, isa, id=f"{ops.FORMAT_NAMES[fmt].replace(' ', '_')}-"
                                    f"{ops.ISA_LABEL[isa]}")
         for fmt in (K.FMT_F16, K.FMT_BF16, K.FMT_BF16_PAIRS, K.FMT_Q8_0, K.FMT_F32)
         for isa in (K.ISA_SCALAR, K.ISA_AVX2, K.ISA_AVX512)
         if not (fmt == K.FMT_BF16_PAIRS and isa == K.ISA_AVX2)]


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """What the Q8_0 kernels multiply by: x rounded per block of 32 to int8 times max|x| / 127."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    s = blocks / torch.where(d == 0, torch.ones_like(d), d)
    return ((s.sign() * (s.abs() + 0.5).floor()) * d).reshape(m, k)


def reference(x: torch.Tensor, packed: ops.Packed, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's x @ W.T (+ bias) in float64 on the weights the kernel holds and the activations
    it reads, and the scale of each output's rounding error (|x| @ |W|.T)."""
    w = ops.unpack(packed).double()
    xr = x.float()
    if packed.fmt == K.FMT_BF16_PAIRS:
        xr = xr.bfloat16().float()
    if packed.fmt == K.FMT_Q8_0:
        xr = quantized_activations(xr)
    y = xr.double() @ w.T + (0 if bias is None else bias.double())
    return y, xr.double().abs() @ w.abs().T + (0 if bias is None else bias.double().abs())


@pytest.mark.parametrize("fmt,isa", PATHS)
@pytest.mark.parametrize("m", [1, 3, 16, 64, 100])
def test_kernel_matches_torch(fmt, isa, m):
    """Every path at 1, 3, 16, 64 rows (and 100: two row chunks), odd N (two tiles and a
    partial one) and odd K (a multiple of 32 for Q8_0), with and without bias: equal to torch
    on the same rounded weights within float32 rounding."""
    reason = reachable(fmt, isa)
    if reason:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(m)
    n, k = 77, (160 if fmt == K.FMT_Q8_0 else 95)
    packed = ops.pack(torch.randn(n, k, generator=gen) * 0.1, fmt)
    x = torch.randn(m, k, generator=gen)
    for bias in (None, torch.randn(n, generator=gen)):
        y = ops.linear(x, packed, bias, isa)
        ref, scale = reference(x, packed, bias)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        err = ((y.double() - ref).abs() / (scale + 1e-30)).max().item()
        assert err < 2e-6, err  # float32 rounding: a few ulps of the sum of |terms|


@pytest.mark.parametrize("fmt", [K.FMT_F16, K.FMT_BF16])
@pytest.mark.parametrize("isa", [K.ISA_AVX2, K.ISA_AVX512])
def test_half_weights_give_each_row_the_same_bits_at_any_batch(fmt, isa):
    """float16 / bfloat16 weights: a row's output does not depend on how many rows run beside
    it, across the ways a tile runs (weights converted in registers, one pass or several, up
    to DIRECT_512 rows on AVX-512; the tile converted once beyond; two row chunks of 64 and
    36 at 100). A pass of one row is the exception on AVX-512 (a decode row alone: its k
    summed in two chains), so the batches here leave none (13 = 12 + 1 would)."""
    reason = reachable(fmt, isa)
    if reason:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(7)
    n, k = 77, 200
    packed = ops.pack(torch.randn(n, k, generator=gen) * 0.1, fmt)
    x = torch.randn(100, k, generator=gen)
    every = ops.linear(x, packed, None, isa)
    for m in (2, 3, 12, 14, 16, 24, 26, 36, 38, 48, 64):
        assert torch.equal(ops.linear(x[:m], packed, None, isa), every[:m]), m
        assert torch.equal(ops.linear(x[-m:], packed, None, isa), every[-m:]), m
    if isa == K.ISA_AVX2:
        alone = torch.cat([ops.linear(x[i:i + 1], packed, None, isa) for i in range(100)])
        assert torch.equal(alone, every)


@pytest.mark.parametrize("fmt,isa", [p for p in PATHS if p.values[0] != K.FMT_Q8_0])
def test_bfloat16_activations_in_and_out(fmt, isa):
    """A bfloat16 model's activations: read as they are, the result rounded to bfloat16 once
    (strided rows too)."""
    reason = reachable(fmt, isa)
    if reason:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(1)
    packed = ops.pack(torch.randn(45, 64, generator=gen) * 0.1, fmt)
    x = torch.randn(5, 2, 64, generator=gen).bfloat16()[:, 0]  # rows 128 elements apart
    y = ops.linear(x, packed, None, isa)
    ref, scale = reference(x, packed, None)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 45)
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + scale * 1e-6).all()


def test_block_formats_refuse_other_k_and_gguf_blocks_pack_as_they_are():
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.pack(torch.randn(8, 48), K.FMT_Q8_0)
    w = torch.randn(40, 96)
    q, d = ops.quantize_q8_0(w)
    assert torch.equal(ops.pack_q8_0_blocks(q, d).data, ops.pack(w, K.FMT_Q8_0).data)
    # the blocks dequantize as GGUF's Q8_0 does: q * d
    expect = (q.float().reshape(40, 3, 32) * d.float()[..., None]).reshape(40, 96)
    assert torch.equal(ops.unpack(ops.pack_q8_0_blocks(q, d)), expect)


def test_registered_and_picked_per_cpu(registries, monkeypatch):
    """The plugin registers one kernel per (weight dtype, instruction set); the core picks the
    best usable one, and ENGINE_CPU_ISA=avx2 caps it to the AVX2 path."""
    monkeypatch.delenv(K.ISA_ENV, raising=False)  # the run's own cap (an ENGINE_CPU_ISA=avx2 run)
    names = {e.name: e.extra["weight_dtype"] for e in registries.linear_kernels}
    assert names["avx2_bf16"] == names["avx512_bf16"] == "bfloat16"
    assert names["avx2_fp16"] == names["avx512_fp16"] == "float16"
    assert names["avx2_q8_0"] == names["avx512_q8_0"] == "q8_0"
    cpu = torch.device("cpu")
    best = "avx512" if HAS[K.ISA_AVX512] else "avx2"
    assert resolve_linear_kernel(registries, "float16", cpu).name == f"{best}_fp16"
    monkeypatch.setenv(K.ISA_ENV, "avx2")
    assert resolve_linear_kernel(registries, "bfloat16", cpu).name == "avx2_bf16"
    # q8_0: the weight-only kernel is the default (tests/test_weight_only.py), the int8 one by name
    assert resolve_linear_kernel(registries, "q8_0", cpu).name == "avx2_q8_0_f32"
    assert resolve_linear_kernel(registries, "q8_0", cpu, forced="avx2_q8_0").name == "avx2_q8_0"
    with pytest.raises(BackendUnavailable, match="ENGINE_CPU_ISA=avx2 limits the kernels"):
        resolve_linear_kernel(registries, "bfloat16", cpu, forced="avx512_bf16")
    with pytest.raises(BackendUnavailable, match="keeps float16 weights"):
        resolve_linear_kernel(registries, "bfloat16", cpu, forced="avx2_fp16")
    assert resolve_linear_kernel(registries, "bfloat16", torch.device("cuda")) is None
    monkeypatch.setenv(K.ISA_ENV, "scalar")
    assert resolve_linear_kernel(registries, "bfloat16", cpu) is None  # the core's own then
    monkeypatch.setenv(K.ISA_ENV, "avx3")
    with pytest.raises(BackendUnavailable, match="ENGINE_CPU_ISA='avx3' is not one of"):
        resolve_linear_kernel(registries, "bfloat16", cpu, forced="avx2_bf16")


# --------------------------------------------------------------------------- the engine

def runner(path, registries, device, dtype, compile_max_tokens=None):
    r = ModelRunner(path, registries=registries, device=device, dtype=dtype,
                    compile_max_tokens=compile_max_tokens)
    r.init_kv_pool(2048)
    return r


def prompts(path):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    return [tok(t).input_ids for t in ("Beautiful is better than ugly.", "Now",
                                       "Explicit is better than implicit. Simple is better "
                                       "than complex. Complex is better than complicated.")]


ISAS = [pytest.param("avx512", id="avx512"), pytest.param("avx2", id="avx2-forced")]


def use_isa(isa, monkeypatch):
    if isa == "avx512" and not HAS[K.ISA_AVX512]:
        pytest.skip("this CPU has no AVX-512")
    if not HAS[K.ISA_AVX2]:
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv(K.ISA_ENV, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_float16_engine_matches_hf_on_the_rounded_weights(tiny_model_dir, registries,
                                                          cpu_device, monkeypatch, isa,
                                                          compiled):
    """--dtype float16 on a CPU through the plugin's kernel (eager, and inside a torch.compile
    graph through engine::prepacked_linear): logits within float32 rounding of HF in float32
    on the float16-rounded weights, greedy tokens equal."""
    use_isa(isa, monkeypatch)
    r = runner(tiny_model_dir, registries, cpu_device, "float16",
               compile_max_tokens=256 if compiled else None)
    assert f"float16 weights, {isa}_fp16 kernel (engine-cpu-kernels" in r.linear_kernel
    packed = [m for m in r.model.modules() if hasattr(m, "packed")]
    assert packed and all(m.packed_kind == "plugin" for m in packed)
    hf = hf_on_half_weights(tiny_model_dir)
    ps = prompts(tiny_model_dir)
    compare_prompt_logits(r, hf, ps, 1e-4)
    for p, out in zip(ps, greedy_generate(r, ps, 16)):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=2)
        assert out == ref[0, len(p):].tolist()


KV_TOL = 2e-3  # float16 K/V: 11 bits of mantissa


def test_engine_float16_keeps_its_kv_cache_in_float16(tiny_model_dir):
    """`--dtype float16` on a CPU (float16 weights, float32 arithmetic): `--kv-cache-dtype
    auto` stores K/V in float16 as SGLang's auto (the model's dtype) and llama.cpp's cache do:
    every prompt token's logits within float16's rounding of HF's on the rounded weights (the
    random model's greedy tokens have near-ties that K/V's rounding flips); a KV dtype given
    explicitly stands, and a float32 model, or one under --quantization, keeps a float32
    cache."""
    from engine import Engine

    e = Engine(tiny_model_dir, device="cpu", dtype="float16", max_total_tokens=512)
    assert e.config.kv_cache_dtype == "fp16" and e.runner.kv_storage_dtype == torch.float16
    hf, ps = hf_on_half_weights(tiny_model_dir), prompts(tiny_model_dir)
    compare_prompt_logits(e.runner, hf, ps, KV_TOL)
    with pytest.raises(AssertionError):  # (the float16 cache is what the tolerance is for)
        compare_prompt_logits(e.runner, hf, ps, 1e-4)
    explicit = Engine(tiny_model_dir, device="cpu", dtype="float16", kv_cache_dtype="bf16",
                      max_total_tokens=512)
    assert explicit.runner.kv_storage_dtype == torch.bfloat16
    f32 = Engine(tiny_model_dir, device="cpu", max_total_tokens=512)
    assert f32.config.kv_cache_dtype == "auto" and f32.runner.kv_storage_dtype == torch.float32
    pytest.importorskip("engine_quant_int8")  # under a --quantization the cache stays float32
    q = Engine(tiny_model_dir, device="cpu", dtype="float16", quantization="w8a8_int8",
               max_total_tokens=512)
    assert q.config.kv_cache_dtype == "auto" and q.runner.kv_storage_dtype == torch.float32


@pytest.mark.parametrize("isa", ISAS)
def test_bfloat16_engine_matches_the_core_path(tiny_model_dir, registries, cpu_device,
                                               monkeypatch, isa):
    """--dtype bfloat16 on a CPU: the plugin's kernel against the core's bfloat16 F.linear
    (oneDNN), both accumulating in float32 and rounding each linear's output to bfloat16:
    logits within bfloat16 rounding, greedy tokens equal."""
    use_isa(isa, monkeypatch)
    ours = runner(tiny_model_dir, registries, cpu_device, "bfloat16")
    kernel = "avx512_bf16" if isa == "avx512" and FEATURES & K.FEAT_AVX512_BF16 else \
        f"{isa}_bf16"
    assert f"bfloat16 weights, {kernel} kernel (engine-cpu-kernels" in ours.linear_kernel
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "torch")
    core = runner(tiny_model_dir, registries, cpu_device, "bfloat16")
    assert "F.linear" in core.linear_kernel
    ps = prompts(tiny_model_dir)
    a, b = prefill_logits(ours, ps, True).float(), prefill_logits(core, ps, True).float()
    assert (a - b).abs().max().item() <= 0.03 * max(1.0, b.abs().max().item())
    assert greedy_generate(ours, ps, 16) == greedy_generate(core, ps, 16)


def test_forcing_a_kernel_the_model_cannot_use_is_an_error(tiny_model_dir, registries,
                                                           cpu_device, monkeypatch):
    monkeypatch.delenv(K.ISA_ENV, raising=False)  # the run's own cap (an ENGINE_CPU_ISA run)
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "avx2_bf16")
    with pytest.raises(BackendUnavailable,
                       match="keeps bfloat16 weights and the model runs with float32 ones"):
        runner(tiny_model_dir, registries, cpu_device, "float32")
    with pytest.raises(BackendUnavailable, match="keeps bfloat16 weights"):
        runner(tiny_model_dir, registries, cpu_device, "float16")
