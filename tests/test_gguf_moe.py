"""Mixture-of-experts GGUF files: Qwen3-MoE (llama.cpp's "qwen3moe", with a dense layer among
the sparse ones, top-k weights renormalized) and Mixtral (a "llama" file with experts: q/k rows
permuted, no sliding window): the router as ffn_gate_inp, each projection of a layer's experts
stacked in one ffn_*_exps tensor, written from tiny random HF checkpoints as llama.cpp's
converters write them. F32: the HF model they came from, logits and greedy tokens; quantized:
an HF model holding the file's weights as gguf-py dequantizes them (transformers' own GGUF
loader reads neither the expert sizes nor a dense layer of Qwen3-MoE, nor Mixtral files)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from engine import Engine
from engine.layers.moe import Expert
from engine.layers.moe_grouped import grouped_kernel
from engine.models.block_weights import block_kernel
from engine_testing.checkpoints import MOE_CASES
from engine_testing.generation import greedy_generate
from engine_testing.gguf_writer import GLOBAL, PER_LAYER
from engine_testing.logits import compare_prompt_logits, float32_runner, hf_reference

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ARCH, CASE = MOE_CASES["qwen3_moe_mlp_only"]  # 8 experts, top-3, renormalized; layer 1 dense
MIXTRAL = ("MixtralForCausalLM", {**MOE_CASES["mixtral_window"][1], "sliding_window": None})
# each family: (architecture, config, sizes every block divides (K-quants: 256), the HF names
# of its router and experts, llama.cpp's stacked tensor -> HF projection, q/k rows permuted)
FAMILIES = {
    "qwen3moe": (ARCH, CASE, {**CASE, "hidden_size": 256, "intermediate_size": 512,
                              "moe_intermediate_size": 256}, "mlp.gate", "mlp.experts",
                 {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                  "ffn_down_exps": "down_proj"}, False),
    "mixtral": (*MIXTRAL, {**MIXTRAL[1], "hidden_size": 256, "intermediate_size": 256},
                "block_sparse_moe.gate", "block_sparse_moe.experts",
                {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}, True),
}
LOGIT_TOL = 1e-4  # max |ours - reference| <= LOGIT_TOL * max(1, max |reference|)
PROMPTS = [[1, 17, 94, 301, 5, 77, 12], [3, 250, 251, 9], [44] * 5 + [45, 46]]


hf_model, runner_for = hf_reference, float32_runner


def dequantized_copy(hf_dir: str, gguf_path: str, out_dir: str, family: str) -> str:
    """``hf_dir`` with its weights replaced by the GGUF's, dequantized by gguf-py and renamed
    back to HF's names here (independently of the engine's reader), q/k rows unpermuted."""
    import gguf
    from safetensors.numpy import save_file

    _, _, _, router, experts, stacks, permuted = FAMILIES[family]
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    back = {v: k for k, v in GLOBAL.items()}
    layer_back = {v: k for k, v in PER_LAYER.items() if not k.endswith(".gate")}
    layer_back["ffn_gate_inp"] = router
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            tuple(int(d) for d in reversed(t.shape.tolist()))).astype(np.float32)
        stem, _, suffix = t.name.rpartition(".")
        if t.name in back:
            weights[back[t.name]] = arr
            continue
        _, layer, piece = stem.split(".")
        if piece in stacks:
            for e in range(arr.shape[0]):
                weights[f"model.layers.{layer}.{experts}.{e}.{stacks[piece]}.{suffix}"] = \
                    np.ascontiguousarray(arr[e])
        else:
            if permuted and piece in heads:  # (pair, half) -> (half, pair) within each head
                h = heads[piece]
                arr = np.ascontiguousarray(arr.reshape(h, -1, 2, *arr.shape[1:]).swapaxes(1, 2)
                                           .reshape(arr.shape))
            weights[f"model.layers.{layer}.{layer_back[piece]}.{suffix}"] = arr
    shutil.copytree(hf_dir, out_dir)
    os.remove(os.path.join(out_dir, "model.safetensors"))
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def test_the_file_is_written_as_llama_cpp_writes_it(tiny_gguf_factory):
    import gguf

    r = gguf.GGUFReader(tiny_gguf_factory(ARCH, "F32", **CASE))
    fields = {k: r.fields[k].contents() for k in r.fields if k.startswith("qwen3moe.expert")}
    assert fields == {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 3,
                      "qwen3moe.expert_feed_forward_length": CASE.get(
                          "moe_intermediate_size", 64)}
    shapes = {t.name: t.shape.tolist() for t in r.tensors if t.name.startswith("blk.0.ffn")}
    hidden, inter = 128, shapes["blk.0.ffn_gate_exps.weight"][1]
    assert shapes == {"blk.0.ffn_gate_inp.weight": [hidden, 8],
                      "blk.0.ffn_gate_exps.weight": [hidden, inter, 8],
                      "blk.0.ffn_up_exps.weight": [hidden, inter, 8],
                      "blk.0.ffn_down_exps.weight": [inter, hidden, 8],
                      "blk.0.ffn_norm.weight": [hidden]}
    assert "blk.1.ffn_gate.weight" in {t.name for t in r.tensors}  # the dense layer


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f32_file_matches_the_hf_model_it_came_from(family, tiny_model_factory,
                                                    tiny_gguf_factory, registries, cpu_device):
    arch, case = FAMILIES[family][:2]
    runner = runner_for(tiny_gguf_factory(arch, "F32", **case), registries, cpu_device)
    config = runner.model_config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == \
        (arch, 8, case["num_experts_per_tok"])
    assert config.norm_topk_prob
    assert config.mlp_only_layers == ((1,) if family == "qwen3moe" else ())
    hf = hf_model(tiny_model_factory(arch, **case))
    compare_prompt_logits(runner, hf, PROMPTS, LOGIT_TOL)
    for p, out in zip(PROMPTS, greedy_generate(runner, PROMPTS, 16)):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=2)
        assert out == ref[0, len(p):].tolist()


@pytest.mark.parametrize("family,qtype", [("qwen3moe", "Q8_0"), ("qwen3moe", "Q4_1"),
                                          ("qwen3moe", "Q4_K"), ("mixtral", "Q4_0"),
                                          ("mixtral", "Q6_K")])
def test_quantized_file_matches_its_dequantized_weights(family, qtype, tiny_model_factory,
                                                        tiny_gguf_factory, registries,
                                                        cpu_device, tmp_path):
    arch, _, wide = FAMILIES[family][:3]
    path = tiny_gguf_factory(arch, qtype, **wide)
    import gguf

    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors
             if t.name.endswith("_exps.weight")}
    assert types == {qtype}  # the experts really are stored in that type
    runner = runner_for(path, registries, cpu_device)
    hf = hf_model(dequantized_copy(tiny_model_factory(arch, **wide), path,
                                   str(tmp_path / "dequantized"), family))
    compare_prompt_logits(runner, hf, PROMPTS, LOGIT_TOL)
    # where a kernel runs the experts' blocks as they are (Q8_0, Q4_0, Q4_1), the sparse
    # layers run them grouped (the K-quants: dequantized, grouped as float32 where a float32
    # kernel with a grouped GEMM runs); the logits above are the dequantized weights' either way
    block = block_kernel(registries, qtype.lower()) if qtype.lower() in ("q8_0", "q4_0",
                                                                          "q4_1") else None
    experts = [m for m in runner.model.modules() if isinstance(m, Expert)]
    if block is not None:
        assert f"{block.name} kernel" in runner.moe_kernel, runner.moe_kernel
        assert all(e.gate_up_proj.kernel is block.obj and e.down.kernel is block.obj
                   for e in experts)
    elif grouped_kernel(registries, cpu_device.torch_device, torch.float32, False)[0]:
        assert "_f32 kernel (engine-cpu-kernels" in runner.moe_kernel, runner.moe_kernel


def test_the_engine_serves_the_file_as_the_checkpoint(tiny_model_factory, tiny_gguf_factory):
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    prompts = ["Hello there", "Flat is better than nested."]
    outs = []
    for path in (tiny_model_factory(ARCH, **CASE), tiny_gguf_factory(ARCH, "F32", **CASE)):
        engine = Engine(path, max_total_tokens=512, chunked_prefill_size=8,
                        grammar_backend="none")
        outs.append([o["output_ids"] for o in engine.generate(prompts, params)])
    assert outs[0] == outs[1]
    with open(os.path.join(tiny_model_factory(ARCH, **CASE), "config.json")) as f:
        assert json.load(f)["norm_topk_prob"]  # llama.cpp's qwen3moe always renormalizes


def test_ranks_load_their_experts_from_the_file(tiny_gguf_factory, monkeypatch):
    """--tp-size 2 --ep-size 2 on a Q8_0 file: each rank dequantizes and keeps its 4 experts
    of each stacked tensor, and the ranks generate what one process does."""
    monkeypatch.setenv("ENGINE_PARALLEL_CHECK", "1")
    path = tiny_gguf_factory(ARCH, "Q8_0", **CASE)
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for parallel in ({}, {"tp_size": 2, "ep_size": 2}):
        engine = Engine(path, max_total_tokens=512, grammar_backend="none",
                        attention_backend="torch_native", dist_timeout=60, **parallel)
        try:
            outs.append([o["output_ids"] for o in engine.generate(["Hello there", "abc"],
                                                                  params)])
            if parallel:
                assert engine.runner.info()["experts_per_rank"] == 4
        finally:
            engine.close()
    assert outs[0] == outs[1]
