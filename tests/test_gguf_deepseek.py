"""DeepSeek-V2/V3 GGUFs (llama.cpp's "deepseek2"): tiny files written as llama.cpp's converter
writes them (engine_testing.gguf_writer: MLA's kv_b_proj split into attn_k_b / attn_v_b, MQA
metadata, the experts stacked, exp_probs_b, yarn's log multiplier) give the HF model's logits
and greedy tokens; a quantized file gives those of an HF model holding gguf-py's
dequantization of it (renamed back here, independently of the engine's reader), its Q8_0 /
Q4_1 experts run as blocks."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from engine.layers.moe import Expert
from engine.models.block_weights import block_kernel
from engine.models.checkpoint import open_checkpoint
from engine_testing.checkpoints import DEEPSEEK_CASES, YARN
from engine_testing.generation import greedy_generate
from engine_testing.gguf_writer import GLOBAL, PER_LAYER
from engine_testing.logits import compare_prompt_logits, float32_runner, hf_reference

LOGIT_TOL = 1e-4  # max |ours - reference| <= LOGIT_TOL * max(1, max |reference|)
PROMPTS = [[1, 17, 94, 301, 5, 77, 12], [3, 250, 251, 9], [44] * 5 + [45, 46]]
# llama.cpp rotates adjacent pairs in every deepseek2 file: the interleaved cases
CASES = ["v2_lite_greedy", "v2_group_limited", "v3_noaux_tc"]


def overrides(case: str) -> tuple[str, dict]:
    """A case as the file can say it: yarn's mscale equal to mscale_all_dim (a GGUF keeps the
    latter alone, and llama.cpp runs both as it)."""
    arch, ov = DEEPSEEK_CASES[case]
    ov = dict(ov)
    if ov.get("rope_parameters", {}).get("rope_type") == "yarn":
        ov["rope_parameters"] = {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}
    return arch, ov


hf_model, runner_for = hf_reference, float32_runner


def dequantized_copy(hf_dir: str, gguf_path: str, out_dir: str) -> str:
    """``hf_dir`` with its weights replaced by the GGUF's, dequantized by gguf-py and renamed
    back to HF's names here: attn_k_b / attn_v_b joined into kv_b_proj, the experts unstacked,
    exp_probs_b back to the gate's e_score_correction_bias."""
    import gguf
    from safetensors.numpy import save_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        heads = json.load(f)["num_attention_heads"]
    back = {v: k for k, v in GLOBAL.items()}
    layer_back = {v: k for k, v in PER_LAYER.items() if k != "block_sparse_moe.gate"}
    stacks = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
              "ffn_down_exps": "down_proj"}
    weights, halves = {}, {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            tuple(int(d) for d in reversed(t.shape.tolist()))).astype(np.float32)
        if t.name in back:
            weights[back[t.name]] = arr
            continue
        stem, _, suffix = t.name.rpartition(".")
        _, layer, piece = stem.split(".")
        prefix = f"model.layers.{layer}"
        if piece in stacks:
            for e in range(arr.shape[0]):
                weights[f"{prefix}.mlp.experts.{e}.{stacks[piece]}.{suffix}"] = \
                    np.ascontiguousarray(arr[e])
        elif piece in ("attn_k_b", "attn_v_b"):
            halves.setdefault(layer, {})[piece] = arr
        elif piece == "exp_probs_b":
            weights[f"{prefix}.mlp.gate.e_score_correction_bias"] = arr
        else:
            weights[f"{prefix}.{layer_back[piece]}.{suffix}"] = arr
    for layer, h in halves.items():  # per head: the nope rows (k_b transposed back), then v
        k_b, v_b = h["attn_k_b"], h["attn_v_b"]
        weights[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = np.ascontiguousarray(
            np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(
                heads * (k_b.shape[2] + v_b.shape[1]), -1))
    shutil.copytree(hf_dir, out_dir)
    os.remove(os.path.join(out_dir, "model.safetensors"))
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def test_the_file_is_written_as_llama_cpp_writes_it(tiny_gguf_factory):
    import gguf

    arch, ov = overrides("v3_noaux_tc")
    r = gguf.GGUFReader(tiny_gguf_factory(arch, "F32", **ov))
    fields = {k: r.fields[k].contents() for k in r.fields if k.startswith("deepseek2.")}
    assert fields["deepseek2.attention.head_count_kv"] == 1  # MLA as MQA
    assert fields["deepseek2.attention.key_length"] == 32 + 16  # kv_lora_rank + rope
    assert fields["deepseek2.attention.key_length_mla"] == 24 + 16  # nope + rope
    assert fields["deepseek2.expert_gating_func"] == 2  # sigmoid
    assert fields["deepseek2.expert_group_count"] == 4
    assert fields["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.0707)
    shapes = {t.name: t.shape.tolist() for t in r.tensors if t.name.startswith("blk.1.")}
    heads = 4
    assert shapes["blk.1.attn_k_b.weight"] == [24, 32, heads]  # gguf: reversed [H, lora, nope]
    assert shapes["blk.1.attn_v_b.weight"] == [32, 20, heads]
    assert shapes["blk.1.exp_probs_b.bias"] == [16]
    assert "blk.1.ffn_gate_shexp.weight" in shapes and "blk.1.ffn_gate_exps.weight" in shapes


@pytest.mark.parametrize("case", CASES)
def test_f32_file_matches_the_hf_model_it_came_from(case, tiny_model_factory, tiny_gguf_factory,
                                                     registries, cpu_device):
    arch, ov = overrides(case)
    path = tiny_gguf_factory(arch, "F32", **ov)
    config = open_checkpoint(path).hf_config
    assert config["architectures"] == [arch]
    assert config["topk_method"] == DEEPSEEK_CASES[case][1].get("topk_method", "noaux_tc")
    assert config["q_lora_rank"] == ov["q_lora_rank"]
    runner = runner_for(path, registries, cpu_device)
    hf = hf_model(tiny_model_factory(arch, **ov))
    compare_prompt_logits(runner, hf, PROMPTS, LOGIT_TOL)
    for p, out in zip(PROMPTS, greedy_generate(runner, PROMPTS, 16)):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=2)
        assert out == ref[0, len(p):].tolist()


@pytest.mark.parametrize("case,qtype", [("v3_noaux_tc", "Q8_0"), ("v2_lite_greedy", "Q4_1")])
def test_quantized_file_matches_its_dequantized_weights(case, qtype, tiny_model_factory,
                                                        tiny_gguf_factory, registries,
                                                        cpu_device, tmp_path):
    """Widths of 64 and more, so that blocks of 32 divide the rows (the narrower ones stay
    F32, as llama.cpp leaves them); the experts' blocks run as they are where a kernel for
    them runs."""
    arch, ov = overrides(case)
    wide = {**ov, "hidden_size": 128, "moe_intermediate_size": 64, "intermediate_size": 128}
    path = tiny_gguf_factory(arch, qtype, **wide)
    runner = runner_for(path, registries, cpu_device)
    hf = hf_model(dequantized_copy(tiny_model_factory(arch, **wide), path,
                                   str(tmp_path / "dequantized")))
    compare_prompt_logits(runner, hf, PROMPTS, LOGIT_TOL)
    block = block_kernel(registries, qtype.lower())
    if block is not None:
        experts = [m for m in runner.model.modules() if isinstance(m, Expert)]
        assert experts and all(e.gate_up_proj.kernel is block.obj for e in experts)
        assert f"{block.name} kernel" in runner.moe_kernel, runner.moe_kernel
