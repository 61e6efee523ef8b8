"""Mixture-of-experts models (Qwen3-MoE, Mixtral: engine/models/moe.py, layers/moe.py) against
Hugging Face transformers: the config's MoE fields, the sparse block against transformers' own
block, and tiny random models' logits and greedy tokens (float32 with prepacked and plain
linears, float16 weights on the CPU). The engine's whole path is tests/test_moe_engine.py."""

from __future__ import annotations

import pytest
import torch

from engine.layers.linear import PrepackedWeight
from engine.layers.moe import Expert, Router, SparseMoE
from engine.models.config import ModelConfig
from engine.quality import prefill_logits as prefill
from engine.registry import EngineError
from engine.runner import ModelRunner
from engine_testing.checkpoints import MOE_CASES
from engine_testing.generation import greedy_generate
from engine_testing.logits import assert_close_logits, compare_prompt_logits

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# max |ours - HF| <= LOGIT_TOL * max(1, max |HF logit|), the dense families' tolerance: in
# float32 the router sees the same hidden states to ~1e-7, so every token picks HF's experts
# and the logits differ by float32 rounding only (measured <= 9e-7 relative on these cases)
LOGIT_TOL = 1e-4
PROMPTS = [
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than "
    "complex. Complex is better than complicated.",
    "Now",
    "Errors should never pass silently, unless explicitly silenced.",
    "Flat is better than nested. Sparse is better than dense.",
]


@pytest.fixture(scope="module", params=list(MOE_CASES))
def moe_dir(request, tiny_model_factory):
    arch, overrides = MOE_CASES[request.param]
    return tiny_model_factory(arch, **overrides)


def hf_model(path, rounded_half: bool = False):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # compare full-length continuations
    if rounded_half:  # what --dtype float16 stores: every linear weight, experts' too
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("proj.weight", "lm_head.weight", "experts.gate_up_proj",
                                  "experts.down_proj")):
                    p.copy_(p.half().float())
    return model


def encode(path):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    return [tok(t).input_ids for t in PROMPTS]


def runner_for(path, registries, device, dtype="float32"):
    runner = ModelRunner(path, registries=registries, device=device, dtype=dtype)
    runner.init_kv_pool(4096)
    return runner


def assert_greedy_equal(runner, hf, prompts, steps):
    ours = greedy_generate(runner, prompts, steps)
    for p, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False,
                          pad_token_id=2)
        assert out == ref[0, len(p):].tolist()
    assert runner.kv_pool.free_slots == runner.kv_pool.size


# -- the config ------------------------------------------------------------------------------
BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
        "intermediate_size": 128, "vocab_size": 100}


@pytest.mark.parametrize("extra,sparse", [
    ({"num_experts": 8, "decoder_sparse_step": 2}, [1, 3]),
    ({"num_local_experts": 8, "mlp_only_layers": [0, 2]}, [1, 3]),  # transformers 5's name
    ({"num_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, [1]),
    ({"num_experts": 0}, []),  # transformers: no experts, every layer dense
])
def test_qwen3_moe_config_says_which_layers_are_sparse(extra, sparse):
    c = ModelConfig.from_hf({**BASE, "architectures": ["Qwen3MoeForCausalLM"],
                             "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                             "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
                             "output_router_logits": False, **extra})
    assert [i for i in range(4) if c.is_moe_layer(i)] == sparse
    assert c.qk_norm and c.norm_topk_prob and c.intermediate_size == 128
    if sparse:
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 32)


def test_mixtral_config_every_layer_sparse_top2_renormalized_with_its_window():
    c = ModelConfig.from_hf({**BASE, "architectures": ["MixtralForCausalLM"],
                             "num_local_experts": 8, "num_experts_per_tok": 2,
                             "sliding_window": 16, "router_jitter_noise": 0.0})
    assert all(c.is_moe_layer(i) for i in range(4)) and c.norm_topk_prob
    assert (c.num_experts, c.moe_intermediate_size) == (8, 128)
    assert c.sliding_window_layers == (0, 1, 2, 3) and not c.qk_norm
    dense = ModelConfig.from_hf({**BASE, "architectures": ["LlamaForCausalLM"]})
    assert dense.num_experts == 0 and not dense.is_moe_layer(1)


@pytest.mark.parametrize("extra,message", [
    ({"num_experts_per_tok": 9}, "expected 1 <= num_experts_per_tok <= the experts"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step is 0 in config.json"),
    ({"mlp_only_layers": [4]}, r"mlp_only_layers lists \[4\] .* layers 0..3"),
])
def test_bad_moe_fields_are_refused_with_the_field(extra, message):
    hf = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32, **extra}
    with pytest.raises(EngineError, match=message):
        ModelConfig.from_hf(hf)


# -- the sparse block against transformers' block --------------------------------------------
def hf_block(arch: str, top_k: int, norm: bool, experts_impl: str):
    import transformers

    kw = dict(hidden_size=64, intermediate_size=48, moe_intermediate_size=48,
              num_experts_per_tok=top_k, num_hidden_layers=1, num_attention_heads=4)
    if arch == "MixtralForCausalLM":
        config = transformers.MixtralConfig(num_local_experts=8, **kw)
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    else:
        config = transformers.Qwen3MoeConfig(num_experts=8, norm_topk_prob=norm, **kw)
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    config._experts_implementation = experts_impl
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return block.eval()


def ours_like(block, arch: str, top_k: int, norm: bool) -> SparseMoE:
    mixtral = arch == "MixtralForCausalLM"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    moe = SparseMoE(64, 48, 8, top_k, norm or mixtral, names, float32_weights=mixtral)
    with torch.no_grad():
        moe.gate.weight.copy_(block.gate.weight)
        for e, expert in enumerate(moe.experts):
            expert.gate_up_proj.weight.copy_(block.experts.gate_up_proj[e])
            expert.down.weight.copy_(block.experts.down_proj[e])
    return moe


@pytest.mark.parametrize("experts_impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,top_k,norm", [("Qwen3MoeForCausalLM", 3, False),
                                             ("Qwen3MoeForCausalLM", 2, True),
                                             ("MixtralForCausalLM", 2, True)])
def test_sparse_block_equals_transformers_block(arch, top_k, norm, dtype, experts_impl):
    """The same routing and combine as transformers' block (both of its expert paths), in
    float32 and in bfloat16, where Qwen3-MoE weights the experts in bfloat16 and Mixtral in
    float32; a token alone gets what it gets in a batch."""
    block = hf_block(arch, top_k, norm, experts_impl).to(dtype)
    moe = ours_like(block, arch, top_k, norm).to(dtype)
    x = torch.randn(1, 37, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        ref = block(x)[0]
        out = moe(x[0])
        alone = torch.cat([moe(x[0, i:i + 1]) for i in range(5)])
    assert out.dtype == dtype
    # of the largest output: float32 measures <= 3.2e-7 (rounding); bfloat16 measures 0 against
    # the grouped_mm path (the same ops) and <= 5.6e-3 against eager, which accumulates the
    # experts in a bfloat16 buffer (an ulp of bfloat16 is 2**-8 = 3.9e-3 of a value)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    assert torch.allclose(alone.float(), out[:5].float(), rtol=0, atol=tol * 4)
    # every expert got tokens: the loop over active experts really ran them all
    _, ids = torch.topk(moe.gate(x[0].float() if dtype == torch.float32 else x[0]), top_k)
    assert ids.unique().numel() == 8


# -- tiny models, end to end through the runner ----------------------------------------------
def test_checkpoint_layout_loads_as_packed_experts(moe_dir, registries, cpu_device):
    runner = runner_for(moe_dir, registries, cpu_device)
    c = runner.model_config
    sparse = [i for i in range(c.num_layers) if c.is_moe_layer(i)]
    assert sparse and len(sparse) < c.num_layers or c.architecture == "MixtralForCausalLM"
    experts = [m for m in runner.model.modules() if isinstance(m, Expert)]
    routers = [m for m in runner.model.modules() if isinstance(m, Router)]
    assert len(experts) == c.num_experts * len(sparse) and len(routers) == len(sparse)
    # each expert's gate+up is one packed projection, its down another, as the dense linears
    # are: for engine-cpu-kernels' float32 kernel where it runs (the experts grouped), else for
    # oneDNN (the per-expert loop); routers float
    packed = [m for m in runner.model.modules() if isinstance(m, PrepackedWeight)]
    assert all(e.gate_up_proj.packed and e.down.packed for e in experts)
    grouped = runner.moe_kernel.startswith("MoE layers: grouped GEMMs")
    assert grouped == (group_entry(registries, cpu_device) is not None), runner.moe_kernel
    assert {m.packed_kind for m in packed} == ({"plugin"} if grouped else {"onednn"})
    assert all(r.weight.dtype == torch.float32 and not r.weight.is_mkldnn for r in routers)
    projections = sum(2 for _ in experts)
    if grouped:  # the experts were packed first, for the grouped GEMM; the rest after them
        assert f"linear layers: {len(packed) - projections} float32 weights, " in \
            runner.linear_kernel
    else:
        assert f"linear layers: {len(packed)} float32 weights prepacked" in runner.linear_kernel


def group_entry(registries, cpu_device):
    from engine.layers.moe_grouped import grouped_kernel

    return grouped_kernel(registries, cpu_device.torch_device, torch.float32, False)[0]


@pytest.mark.parametrize("linear_path", ["prepacked", "per_expert", "plain"])
def test_logits_match_hf(moe_dir, registries, cpu_device, linear_path, monkeypatch):
    """prepacked: the experts grouped where a plugin's grouped GEMM runs; per_expert: the loop
    over oneDNN-packed experts; plain: F.linear everywhere."""
    if linear_path == "plain":
        monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "plain")
    if linear_path == "per_expert":
        monkeypatch.setenv("ENGINE_MOE_KERNEL", "per_expert")
    runner = runner_for(moe_dir, registries, cpu_device)
    assert any(m.packed for m in runner.model.modules() if hasattr(m, "packed")) == \
        (linear_path != "plain")
    assert ("per-expert GEMMs" in runner.moe_kernel) == (
        linear_path != "prepacked" or group_entry(registries, cpu_device) is None)
    hf, prompts = hf_model(moe_dir), encode(moe_dir)
    last = prefill(runner, prompts)
    every = prefill(runner, prompts, return_all_logits=True)
    start = 0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p])).logits[0]
            assert_close_logits(last[i], ref[-1], LOGIT_TOL)
            assert_close_logits(every[start:start + len(p)], ref, LOGIT_TOL)
            start += len(p)


def test_greedy_matches_hf_generate(moe_dir, registries, cpu_device):
    """Prefill of four prompts together, then 32 decode steps of 4 rows (1 token each)."""
    assert_greedy_equal(runner_for(moe_dir, registries, cpu_device), hf_model(moe_dir),
                        encode(moe_dir), 32)


@pytest.mark.parametrize("kernel", ["torch", "auto"])
def test_half_weights_match_hf_on_the_rounded_weights(moe_dir, registries, cpu_device, kernel,
                                                      monkeypatch):
    """--dtype float16 on a CPU: every expert's projections are float16 weights like the dense
    linears (fbgemm's GEMM with "torch"; with "auto" a plugin's kernel where one is installed
    and runs here, engine-cpu-kernels'), float32 arithmetic; equal to HF in float32 on the
    rounded weights (the router stays float32 on both sides)."""
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", kernel)
    runner = runner_for(moe_dir, registries, cpu_device, dtype="float16")
    experts = [m for m in runner.model.modules() if isinstance(m, Expert)]
    kinds = {m.packed_kind for m in runner.model.modules() if isinstance(m, PrepackedWeight)}
    assert len(kinds) == 1 and all(e.gate_up_proj.packed_kind in kinds for e in experts)
    if kernel == "torch":
        assert kinds == {"fp16"}
    hf, prompts = hf_model(moe_dir, rounded_half=True), encode(moe_dir)
    compare_prompt_logits(runner, hf, prompts, LOGIT_TOL)
    assert_greedy_equal(runner, hf, prompts, 16)
