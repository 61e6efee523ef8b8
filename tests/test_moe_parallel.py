"""Mixture-of-experts models over tp ranks (engine/parallel/experts.py, parallel/moe.py):
--tp-size cuts every expert's intermediate dimension, --ep-size gives each rank whole experts
of its own; either way one all-reduce per MoE layer. DeepSeek's MLA heads are cut and its
latent replicated (parallel/mla.py). Through the Engine (rank 0 here, the
others worker processes over gloo) each layout generates exactly what one process generates,
greedy and seeded, with chunked prefill, prefix-cache hits and retraction; a rank loads only
its experts' slices; pipeline stages (--pp-size, with tp and ep too) generate the same;
bad layouts are refused before any process starts. Every wait is bounded
(--dist-timeout)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from engine.engine import Engine
from engine.registry import EngineError
from engine_testing.checkpoints import DEEPSEEK_CASES, MOE_CASES

SHARED = "Beautiful is better than ugly. Explicit is better than implicit. "
PROMPTS = [SHARED + "Simple", SHARED + "Flat is better", "Now",
           "Errors should never pass silently."]
GREEDY = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 20, "temperature": 0.9, "top_p": 0.9, "seed": 7, "ignore_eos": True}
# a small pool admitted with --schedule-conservativeness 0.1: requests retract
BASE = dict(device="cpu", dtype="float32", attention_backend="torch_native", seed=3,
            chunked_prefill_size=16, max_running_requests=6, schedule_conservativeness=0.1,
            dist_timeout=60, max_total_tokens=120)


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    cases = {**MOE_CASES, **DEEPSEEK_CASES,
             # no q LoRA with an attention bias: q_proj apart from kv_a_proj_with_mqa
             "v2_lite_bias": (DEEPSEEK_CASES["v2_lite_greedy"][0],
                              {**DEEPSEEK_CASES["v2_lite_greedy"][1], "attention_bias": True})}
    return {case: tiny_model_factory(*cases[case][:1], **cases[case][1])
            for case in ("qwen3_moe_mlp_only", "mixtral_window", "v3_noaux_tc", "v2_lite_bias",
                         "v2_group_limited")}


@pytest.fixture(autouse=True)
def check_tables(monkeypatch):
    monkeypatch.setenv("ENGINE_PARALLEL_CHECK", "1")


def generate(path: str, **kwargs):
    engine = Engine(path, **BASE, **kwargs)
    try:
        out = engine.generate(PROMPTS * 2, [GREEDY] * len(PROMPTS) + [SEEDED] * len(PROMPTS))
        info = engine.runner.info() if kwargs else None
        return [o["output_ids"] for o in out], engine.scheduler.counters.retracted_reqs, info
    finally:
        engine.close()


@functools.lru_cache(maxsize=None)
def one_process(path: str):
    return generate(path)[:2]


@pytest.mark.parametrize("case,parallel,per_rank", [
    ("qwen3_moe_mlp_only", {"tp_size": 2}, 8),  # every expert cut in two
    ("qwen3_moe_mlp_only", {"tp_size": 2, "ep_size": 2}, 4),  # 4 whole experts a rank
    ("mixtral_window", {"tp_size": 2}, 8),
    ("mixtral_window", {"tp_size": 2, "enable_expert_parallel": True}, 4),  # vLLM's ep = tp
    # 4 ranks: 2 runs of 4 experts, each expert cut over the 2 ranks of its run
    ("qwen3_moe_mlp_only", {"tp_size": 4, "ep_size": 2}, 4),
    # DeepSeek: MLA heads cut, the latent replicated; shared experts and dense layers cut
    ("v3_noaux_tc", {"tp_size": 2, "ep_size": 2}, 8),  # q LoRA, sigmoid noaux_tc, 16 experts
    ("v2_lite_bias", {"tp_size": 2}, 8),  # q_proj alone (a bias), a dense first layer
    ("v2_group_limited", {"tp_size": 2, "ep_size": 2}, 4),  # q LoRA, biases, group-limited
])
def test_moe_over_ranks_generates_what_one_process_does(models, case, parallel, per_rank):
    ref, retracted = one_process(models[case])
    got, retracted_too, info = generate(models[case], **parallel)
    assert got == ref
    assert retracted_too == retracted > 0
    assert info["experts_per_rank"] == per_rank
    assert info["num_experts"] == per_rank * info["ep_size"]
    if case.startswith("v"):  # every rank holds the same latent rows as one process
        assert len({r["kv_bytes_per_token"] for r in info["ranks"]}) == 1


@pytest.mark.parametrize("case,parallel,per_rank", [
    ("qwen3_moe_mlp_only", {"pp_size": 2}, None),  # 2 layers: one a stage
    # a dense first layer: stage 1's layers are sparse by their index in the model
    ("v2_lite_bias", {"pp_size": 2}, None),
    ("mixtral_window", {"pp_size": 2, "tp_size": 2, "ep_size": 2}, 4),  # 4 ranks
])
def test_moe_over_pipeline_stages_generates_what_one_process_does(models, case, parallel,
                                                                   per_rank):
    ref, retracted = one_process(models[case])
    got, retracted_too, info = generate(models[case], **parallel)
    assert got == ref
    assert retracted_too == retracted > 0
    assert info["pp_size"] == 2 and len({r["pp_rank"] for r in info["ranks"]}) == 2
    assert info.get("experts_per_rank") == per_rank


def test_the_start_log_says_where_the_experts_are(models, caplog):
    caplog.set_level(logging.INFO, logger="engine")
    engine = Engine(models["mixtral_window"], **{**BASE, "max_total_tokens": 512}, tp_size=2,
                    ep_size=2)
    engine.close()
    assert "MoE: 4 of 8 experts per rank (--ep-size 2)" in caplog.text


@pytest.mark.parametrize("ep", [1, 2])
def test_a_rank_loads_only_its_experts_slices(models, registries, ep):
    """Rank 1 of 2, loaded in this process (loading needs no collective)."""
    import os

    from engine.layers.moe import AbsentExpert
    from engine.models.checkpoint import open_checkpoint
    from engine.models.config import ModelConfig
    from engine.models.loader import load_model
    from engine.parallel.group import TPGroup
    from engine.runner import resolve_model_class
    from safetensors.torch import load_file

    path = models["qwen3_moe_mlp_only"]
    ckpt = open_checkpoint(path)
    config = ModelConfig.from_checkpoint(ckpt, registries.models)
    model = load_model(resolve_model_class(registries, config.architecture), config, ckpt,
                       torch.float32, tp=TPGroup(rank=1, size=2, ep_size=ep))
    full = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            full.update(load_file(os.path.join(path, f)))
    moe, inter = model.model.layers[0].mlp, config.moe_intermediate_size
    assert torch.equal(moe.gate.weight, full["model.layers.0.mlp.gate.weight"])  # whole
    for e, expert in enumerate(moe.experts):
        pre = f"model.layers.0.mlp.experts.{e}."
        if ep == 2 and e < 4:  # rank 1 holds experts 4..7, whole
            assert isinstance(expert, AbsentExpert)
            continue
        rows = slice(None) if ep == 2 else slice(inter // 2, inter)
        gate, up = expert.gate_up_proj.weight.chunk(2)
        assert torch.equal(gate, full[pre + "gate_proj.weight"][rows])
        assert torch.equal(up, full[pre + "up_proj.weight"][rows])
        assert torch.equal(expert.down.weight, full[pre + "down_proj.weight"][:, rows])


@pytest.mark.parametrize("kwargs,match", [
    ({"tp_size": 2, "ep_size": 4}, "--ep-size 4 must divide --tp-size 2"),
    ({"tp_size": 4, "ep_size": 2, "enable_expert_parallel": True},
     "--ep-size 2 and --enable-expert-parallel"),
    ({"tp_size": 2, "enable_dp_attention": True},
     "--enable-dp-attention runs one process per rank"),
    ({"tp_size": 2, "ep_size": 2, "model": "dense"},
     "--ep-size 2 splits a mixture-of-experts model's experts, and LlamaForCausalLM has none"),
])
def test_bad_layouts_are_refused_before_any_process_starts(models, tiny_model_dir, kwargs,
                                                           match):
    name = kwargs.pop("model", "mixtral_window")
    model = tiny_model_dir if name == "dense" else models[name]
    with pytest.raises(EngineError, match=match):
        Engine(model, **{**BASE, **kwargs})


def test_experts_that_do_not_split_over_ep_are_refused(tiny_model_factory):
    from engine.parallel.experts import expert_problem

    path = tiny_model_factory("MixtralForCausalLM", num_local_experts=6, num_experts_per_tok=2)
    with pytest.raises(EngineError, match="6 experts do not split over --ep-size 4: every rank "
                                          "holds the same number of whole experts; use an "
                                          "--ep-size that divides 6"):
        Engine(path, **{**BASE, "tp_size": 4, "ep_size": 4})
    assert "intermediate size 48 does not split over 5" in expert_problem(10, 48, 10, 2)
