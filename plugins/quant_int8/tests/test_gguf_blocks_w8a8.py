"""w8a8_int8 on a GGUF of Q8_0, Q4_0 or Q4_1 blocks (QuantMethod.gguf_blocks /
block_activations): the blocks run as they are through engine-cpu-kernels' int8-activation
kernels (avx512_q8_0 / avx512_q4_1 ... with AVX512_VNNI, else the avx2_ ones: llama.cpp's
arithmetic), exactly as ``ENGINE_LINEAR_KERNEL=<that kernel>`` runs them without
--quantization; anywhere else (other block formats, --dtype float16,
ENGINE_LINEAR_KERNEL=torch) the method converts the model as before; without --quantization
the weight-only kernels stay the default."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import Engine
from engine.layers.linear import LINEAR_KERNEL_ENV
from engine.models.block_weights import quant_block_reason
from engine.models.checkpoint import open_checkpoint
from engine.quality import prefill_logits
from engine.registry import BackendUnavailable, resolve_linear_kernel
from engine_quant_int8.linear import Int8Linear
from engine_quant_int8.method import W8A8Int8Method

K = pytest.importorskip("engine_cpu_kernels.kernel", reason="needs engine-cpu-kernels")
try:
    FEATURES = K.features()
except K.KernelUnavailable as e:  # no compiler, not x86-64
    pytest.skip(f"engine-cpu-kernels cannot build here: {e}", allow_module_level=True)
if not FEATURES & K.FEAT_AVX2:
    pytest.skip("this CPU has no AVX2: engine-cpu-kernels registers no Q8_0 kernel usable here",
                allow_module_level=True)

pytestmark = pytest.mark.usefixtures("single_torch_thread")

BEST = "avx512" if FEATURES & K.FEAT_AVX512_VNNI else "avx2"
NOTE = ("quantization: w8a8_int8 ({origin}), --quantization; on the GGUF's "
        "{fmt} blocks as they are: int8 activations per block of 32 (llama.cpp's arithmetic)")
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 88], list(range(40, 100))]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def engine(path, **kw) -> Engine:
    return Engine(path, max_total_tokens=4096, **kw)


def int8_linears(runner) -> int:
    return sum(isinstance(m, Int8Linear) for m in runner.model.modules())


def outputs(eng: Engine) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuations of PROMPTS, and their prompts' logits at every position."""
    out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    return [o["output_ids"] for o in out], prefill_logits(eng.runner, PROMPTS, True)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_0"])
@pytest.mark.parametrize("isa", [None, "avx2"])
def test_w8a8_int8_on_gguf_blocks_runs_them_through_the_int8_kernel(
        isa, qtype, tiny_gguf_factory, registries, monkeypatch, caplog):
    """As ENGINE_LINEAR_KERNEL=<the int8 kernel of those blocks> without --quantization, token
    for token and logit for logit; no Int8Linear; the start line says how it runs. Q4 blocks
    stay 4-bit (requantizing them per channel would only add rounding)."""
    if isa is not None:
        monkeypatch.setenv(K.ISA_ENV, isa)
    fmt = qtype.lower()
    kernel = f"{isa or BEST}_{fmt}"
    path = tiny_gguf_factory("llama", qtype)
    caplog.set_level(logging.INFO, logger="engine")
    w8a8 = engine(path, quantization="w8a8_int8")
    runner = w8a8.runner
    assert runner.linear_kernel.startswith("linear layers: ")
    assert f"{fmt} GGUF blocks, {kernel} kernel (engine-cpu-kernels" in runner.linear_kernel
    assert "dequantized" not in runner.linear_kernel
    assert int8_linears(runner) == 0
    origin = registries.quantization.get("w8a8_int8").origin
    assert NOTE.format(origin=origin, fmt=fmt) in caplog.messages
    got = outputs(w8a8)

    monkeypatch.setenv(LINEAR_KERNEL_ENV, kernel)
    forced = engine(path)
    assert f"{fmt} GGUF blocks, {kernel} kernel" in forced.runner.linear_kernel
    assert forced.runner.quant_note is None
    ref = outputs(forced)
    assert got[0] == ref[0]
    assert torch.equal(got[1], ref[1])


@pytest.mark.parametrize("qtype,dtype,env", [
    ("Q5_0", "float32", None),          # q5_0 blocks: no int8-activation kernel runs them
    ("Q8_0", "float16", None),          # float16 weights: no block kernels
    ("Q8_0", "float32", "torch"),       # ENGINE_LINEAR_KERNEL=torch: the blocks never run
])
def test_elsewhere_w8a8_int8_converts_the_model_as_before(qtype, dtype, env, tiny_gguf_factory,
                                                         make_runner, monkeypatch):
    if env is not None:
        monkeypatch.setenv(LINEAR_KERNEL_ENV, env)
    runner = make_runner(tiny_gguf_factory("llama", qtype), quantization="w8a8_int8",
                         dtype=dtype)
    assert int8_linears(runner) > 0
    assert "GGUF blocks" not in runner.linear_kernel
    assert runner.quant_note is None


def test_why_w8a8_int8_does_not_run_as_blocks(tiny_gguf_factory, tiny_model_factory, registries,
                                             make_runner):
    method, cpu = W8A8Int8Method(), torch.device("cpu")
    q4_1 = make_runner(tiny_gguf_factory("llama", "Q4_1")).checkpoint
    q8_0 = make_runner(tiny_gguf_factory("llama", "Q8_0")).checkpoint
    hf = make_runner(tiny_model_factory("llama")).checkpoint
    assert q8_0.block_formats() == {"q8_0"} and q4_1.block_formats() >= {"q4_1"}
    assert hf.block_formats() == set()

    def why(ckpt, dtype=torch.float32, half=False, parallel=False, m=method):
        return quant_block_reason(m, ckpt, cpu, dtype, half, parallel, registries)

    assert why(q8_0) is None and why(q4_1) is None
    only_q8 = type("OnlyQ8", (W8A8Int8Method,), {"gguf_blocks": ("q8_0",)})()
    assert why(q4_1, m=only_q8).startswith("the GGUF holds q4_1")
    assert why(hf) == "not a GGUF"
    assert why(q8_0, parallel=True) == "tensor parallelism cuts the weights"
    assert why(q8_0, half=True).startswith("--dtype asks for float16")
    assert why(q8_0, m=type("Plain", (W8A8Int8Method,), {"gguf_blocks": ()})()) == \
        "the method runs no GGUF blocks"
    # a later start asks the cache: neither the GGUF parsed nor its blocks held in memory
    again = open_checkpoint(q4_1.path)
    assert again.block_formats() == q4_1.block_formats()
    assert again._file is None and again._blocks is None


def test_without_quantization_q8_0_blocks_keep_the_weight_only_kernel(tiny_gguf_factory,
                                                                      make_runner):
    runner = make_runner(tiny_gguf_factory("llama", "Q8_0"))
    assert f"q8_0 GGUF blocks, {BEST}_q8_0_f32 kernel" in runner.linear_kernel
    assert runner.quant_note is None


def test_linear_kernels_are_resolved_by_activations(registries, tiny_gguf_factory, make_runner,
                                                    monkeypatch):
    cpu = torch.device("cpu")
    acts = {e.name: e.extra["activations"] for e in registries.linear_kernels
            if e.dist == "engine-cpu-kernels"}
    assert {n for n, a in acts.items() if a == "int8"} == {
        f"{isa}_{fmt}" for isa in ("avx512", "avx2") for fmt in ("q8_0", "q4_1", "q4_0")}
    assert acts["avx2_bf16"] == acts["avx2_q8_0_f32"] == "float32"
    assert resolve_linear_kernel(registries, "q8_0", cpu).name == f"{BEST}_q8_0_f32"
    assert resolve_linear_kernel(registries, "q8_0", cpu,
                                 activations="float32").name == f"{BEST}_q8_0_f32"
    assert resolve_linear_kernel(registries, "q8_0", cpu, activations="int8").name == \
        f"{BEST}_q8_0"
    assert resolve_linear_kernel(registries, "q4_1", cpu, activations="int8").name == \
        f"{BEST}_q4_1"
    assert resolve_linear_kernel(registries, "float16", cpu, activations="int8") is None
    assert resolve_linear_kernel(registries, "q8_0", cpu, forced="avx2_q8_0",
                                 activations="int8").name == "avx2_q8_0"
    with pytest.raises(BackendUnavailable, match=(
            r"linear kernel 'avx2_q8_0_f32' .* cannot run here: it takes float32 activations "
            r"and the model runs with int8 ones\. Usable for q8_0 weights with int8 "
            rf"activations: .*{BEST}_q8_0")):
        resolve_linear_kernel(registries, "q8_0", cpu, forced="avx2_q8_0_f32",
                              activations="int8")
    # forcing the weight-only kernel while w8a8_int8 asks for int8 activations: said at start
    monkeypatch.setenv(LINEAR_KERNEL_ENV, f"{BEST}_q8_0_f32")
    with pytest.raises(BackendUnavailable, match="takes float32 activations"):
        make_runner(tiny_gguf_factory("llama", "Q8_0"), quantization="w8a8_int8")
