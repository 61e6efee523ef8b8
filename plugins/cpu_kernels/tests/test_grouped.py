"""The grouped GEMM (an MoE layer's experts in one call: ``ops.grouped_linear``, the kernels'
``group`` / ``grouped_linear``) against one ``ops.linear`` per expert on every path, and tiny
MoE models through the engine with their sparse layers grouped against the per-expert loop."""

from __future__ import annotations

import pytest
import torch

from engine.quality import prefill_logits
from engine.runner import ModelRunner
from engine_testing.checkpoints import MOE_CASES
from engine_testing.generation import greedy_generate
from engine_cpu_kernels import kernel as K
from engine_cpu_kernels import ops
from test_cpu_kernels import HAS, PATHS, reachable

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# (format, weight-only) per instruction set: the float paths, Q8_0 with int8 activations, and
# the weight-only Q4_1 / Q8_0 modes
GROUPED = [*PATHS, *[pytest.param(fmt, isa, id=f"{ops.FORMAT_NAMES[fmt]}_f32-"
                                              f"{ops.ISA_LABEL[isa]}")
                     for fmt in (K.FMT_Q4_1, K.FMT_Q8_0)
                     for isa in (K.ISA_SCALAR, K.ISA_AVX2, K.ISA_AVX512)]]


def experts(fmt: int, n: int, k: int, count: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [ops.pack(torch.randn(n, k, generator=gen) * 0.1, fmt) for _ in range(count)]


@pytest.mark.parametrize("fmt,isa", GROUPED)
@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_equals_one_linear_per_expert(fmt, isa, threads, request):
    """Uneven experts (none, one, two chunks of 64 rows), one absent (its rows zero), odd N:
    exactly the per-expert GEMMs' results (the same micro-kernels on the same rows)."""
    reason = reachable(fmt, isa)
    if reason:
        pytest.skip(reason)
    weight_only = "_f32-" in request.node.callspec.id
    n, k = 77, 96
    packed = experts(fmt, n, k, 6, seed=fmt)
    packed[4] = None  # another rank's expert
    counts = [3, 0, 70, 1, 5, 12]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(7))
    torch.set_num_threads(threads)
    y = ops.grouped_linear(x, ops.group(packed), offsets, isa, weight_only)
    assert y.shape == (sum(counts), n) and y.dtype == torch.float32
    for e, p in enumerate(packed):
        rows = slice(offsets[e].item(), offsets[e + 1].item())
        want = torch.zeros(counts[e], n) if p is None else \
            ops.linear(x[rows], p, None, isa, weight_only=weight_only)
        assert torch.equal(y[rows], want), e


@pytest.mark.parametrize("fmt", [K.FMT_F32, K.FMT_BF16, K.FMT_F16])
def test_grouped_bfloat16_activations(fmt):
    """A bfloat16 model's rows: read as they are, the result bfloat16, as ops.linear gives."""
    isa = K.ISA_AVX512 if HAS[K.ISA_AVX512] else K.ISA_AVX2
    if not HAS[isa]:
        pytest.skip("this CPU has no AVX2")
    packed = experts(fmt, 40, 64, 3, seed=3)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    offsets = torch.tensor([0, 2, 2, 9])
    y = ops.grouped_linear(x, ops.group(packed), offsets, isa)
    assert y.dtype == torch.bfloat16
    want = torch.cat([ops.linear(x[0:2], packed[0], None, isa),
                      ops.linear(x[2:9], packed[2], None, isa)])
    assert torch.equal(y, want)


def test_grouped_refuses_bad_groups_and_offsets():
    a, b = experts(K.FMT_F32, 32, 64, 1, 0)[0], experts(K.FMT_F32, 64, 64, 1, 0)[0]
    with pytest.raises(ValueError, match="differ in format or shape"):
        ops.group([a, b])
    with pytest.raises(ValueError, match="at least one packed weight"):
        ops.group([None, None])
    grp = ops.group([a, None])
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="offsets must be int64 \\[3\\]"):
        ops.grouped_linear(x, grp, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="not ascending from 0 to the rows"):
        ops.grouped_linear(x, grp, torch.tensor([0, 5, 4]))
    with pytest.raises(ValueError, match="x \\[rows, 64\\]"):
        ops.grouped_linear(torch.randn(4, 32), grp, torch.tensor([0, 2, 4]))


# --------------------------------------------------------------------------- the engine

def moe_runner(path, registries, device, dtype):
    r = ModelRunner(path, registries=registries, device=device, dtype=dtype)
    r.init_kv_pool(2048)
    return r


PROMPTS = [[1, 5, 9, 33, 2, 17, 4, 8, 60, 61, 62, 3], [7], [12, 40, 41, 12, 40, 41, 12]]


@pytest.mark.parametrize("case", ["qwen3_moe_mlp_only", "mixtral_window"])
@pytest.mark.parametrize("dtype,isa", [("float32", "avx512"), ("float32", "avx2"),
                                       ("bfloat16", "avx512"), ("float16", "avx2")])
def test_engine_groups_the_experts(case, dtype, isa, tiny_model_factory, registries, cpu_device,
                                   monkeypatch):
    """A tiny MoE model's sparse layers on the grouped GEMM (the start log's MoE line names
    it): prompt logits equal to the per-expert loop's on the same kernel within float32
    rounding (bfloat16: the same roundings, so within an ulp), greedy tokens equal."""
    if isa == "avx512" and not HAS[K.ISA_AVX512] or not HAS[K.ISA_AVX2]:
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv(K.ISA_ENV, isa)
    arch, overrides = MOE_CASES[case]
    path = tiny_model_factory(arch, **overrides)
    grouped = moe_runner(path, registries, cpu_device, dtype)
    assert grouped.moe_kernel.startswith("MoE layers: grouped GEMMs"), grouped.moe_kernel
    weights = {"float32": "f32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    kernel = "avx512_bf16" if dtype == "bfloat16" and K.features() & K.FEAT_AVX512_BF16 and \
        isa == "avx512" else f"{isa}_{weights}"
    assert f"{kernel} kernel (engine-cpu-kernels" in grouped.moe_kernel
    sparse = [m for m in grouped.model.modules() if getattr(m, "grouped", None) is not None]
    assert sparse and all(m.fused is None for m in sparse)
    monkeypatch.setenv("ENGINE_MOE_KERNEL", "per_expert")
    loop = moe_runner(path, registries, cpu_device, dtype)
    assert "per-expert GEMMs" in loop.moe_kernel and "ENGINE_MOE_KERNEL=per_expert" in \
        loop.moe_kernel
    a = prefill_logits(grouped, PROMPTS, True).float()
    b = prefill_logits(loop, PROMPTS, True).float()
    tol = 1e-5 if dtype != "bfloat16" else 2e-2
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())
    assert greedy_generate(grouped, PROMPTS, 12) == greedy_generate(loop, PROMPTS, 12)


def test_float32_kernel_by_name_runs_every_linear(tiny_model_dir, registries, cpu_device,
                                                  monkeypatch):
    """ENGINE_LINEAR_KERNEL=avx2_f32 on a float32 model: every linear through the plugin's
    float32 kernel (by default only MoE experts take it), logits as oneDNN's."""
    if not HAS[K.ISA_AVX2]:
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "avx2_f32")
    ours = moe_runner(tiny_model_dir, registries, cpu_device, "float32")
    assert "float32 weights, avx2_f32 kernel (engine-cpu-kernels" in ours.linear_kernel
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "torch")
    core = moe_runner(tiny_model_dir, registries, cpu_device, "float32")
    assert "oneDNN" in core.linear_kernel
    a, b = prefill_logits(ours, PROMPTS, True), prefill_logits(core, PROMPTS, True)
    assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())


MIXED = ["Hello there friend", "Flat is better than nested. " * 4, "a b a b a b a b a b", "zz"]
KINDS = [{"temperature": 0, "max_new_tokens": 12},  # greedy
         {"temperature": 0.8, "seed": 5, "max_new_tokens": 10},  # seeded sampling
         {"temperature": 1.0, "seed": 7, "n": 2, "max_new_tokens": 8},  # n > 1
         {"temperature": 0, "max_new_tokens": 6, "logprobs": True, "top_logprobs": 3}]


@pytest.mark.parametrize("mode", [{}, {"enable_overlap_schedule": True},
                                  {"chunked_prefill_size": 8},
                                  {"speculative_algorithm": "NGRAM"}],
                         ids=["plain", "overlap", "chunked", "ngram"])
def test_grouped_experts_serve_every_mode_as_the_loop(mode, tiny_model_factory, monkeypatch):
    """Greedy, seeded sampling, n = 2 and logprobs requests in one batch through the engine,
    each scheduler mode: the grouped experts give the per-expert loop's tokens."""
    from engine import Engine

    arch, overrides = MOE_CASES["qwen3_moe_mlp_only"]
    path = tiny_model_factory(arch, **overrides)
    outs = []
    for kernel in ("auto", "per_expert"):
        monkeypatch.setenv("ENGINE_MOE_KERNEL", kernel)
        engine = Engine(path, max_total_tokens=2048, grammar_backend="none", **mode)
        assert engine.runner.moe_kernel.startswith(
            "MoE layers: grouped GEMMs" if kernel == "auto" else "MoE layers: per-expert")
        outs.append([o["output_ids"] for o in engine.generate(MIXED, KINDS)])
    assert outs[0] == outs[1]
