"""A GGUF's metadata as the HF config.json dict ModelConfig.from_hf reads: the architecture,
the sizes (uniform layers only), rope (linear scaling, or Llama 3's per-frequency factors
tensor; yarn for DeepSeek), the token ids, and the dtype the weights count as.

"deepseek2" files (llama.cpp's DeepSeek-V2/V3) become DeepseekV3ForCausalLM where the experts'
gating is sigmoid (V3's noaux_tc routing, the exp_probs_b correction bias) and
DeepseekV2ForCausalLM where it is softmax (greedy top-k, or group-limited greedy with expert
groups: transformers' V2 scores a group by its best expert, where llama.cpp sums its top two).
Yarn's mscale and mscale_all_dim are both read from yarn_log_multiplier / 0.1, as llama.cpp
runs them (the file keeps only mscale_all_dim)."""

from __future__ import annotations

import os
from typing import Any

from engine.models.gguf import MISSING, ROPE_FREQS, GGUFError, GGUFFile, gguf_package

# general.architecture -> the HF architecture our model registry knows. Mistral's GGUFs say
# "llama" (llama.cpp converts MistralForCausalLM as a Llama, without a sliding window).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "deepseek2": "DeepseekV3ForCausalLM"}  # or V2: see _deepseek2
MODEL_TYPES = {"qwen3moe": "qwen3_moe"}
# a "llama" file with experts is a Mixtral (llama.cpp converts MixtralForCausalLM as "llama")
MIXTRAL = "MixtralForCausalLM"


def checkpoint_dtype(f: GGUFFile) -> str:
    """The dtype the weights were stored in, as config.json would name it: a quantized file
    counts as float16 (its blocks' scales are float16; a CPU computes in float32 anyway)."""
    gguf = gguf_package()
    types = {t.tensor_type for t in f.reader.tensors if len(t.shape) > 1}
    Q = gguf.GGMLQuantizationType
    if types <= {Q.F32}:
        return "float32"
    if types <= {Q.F32, Q.BF16}:
        return "bfloat16"
    return "float16"


def hf_config(f: GGUFFile) -> dict:
    """The metadata as an HF config.json dict (what ModelConfig.from_hf reads)."""
    arch = f.arch
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"Unsupported GGUF architecture '{arch}' (general.architecture in "
            f"'{f.path}'). Supported: {', '.join(ARCHITECTURES)} (the Llama family: "
            f"Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE; DeepSeek-V2/V3).")
    if arch == "deepseek2":
        return _deepseek2(f)
    p = f"{arch}."
    hidden = int(f.get(p + "embedding_length"))
    heads = _uniform(f, p + "attention.head_count")
    kv_heads = _uniform(f, p + "attention.head_count_kv", heads)
    head_dim = int(f.get(p + "attention.key_length", hidden // heads))
    rope_dim = int(f.get(p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"'{f.path}': {p}rope.dimension_count is {rope_dim} but heads have "
                        f"{head_dim} dimensions; partial rotary embeddings are not supported.")
    mixtral = arch == "llama" and f.has(p + "expert_count")
    hf: dict = {
        **_common(f, p),
        "architectures": [MIXTRAL if mixtral else ARCHITECTURES[arch]],
        "model_type": "mixtral" if mixtral else MODEL_TYPES.get(arch, arch),
        # a MoE file with no dense layer may leave it out: its experts' size stands in
        "intermediate_size": _uniform(f, p + "feed_forward_length"
                                      if f.has(p + "feed_forward_length")
                                      else p + "expert_feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in f.tensor_infos,
    }
    if f.has(p + "expert_count"):
        hf.update(_experts(f, p, hf["num_hidden_layers"], mixtral))
    rope = _rope_scaling(f, p, head_dim)
    if rope is not None:
        hf["rope_scaling"] = rope
    return hf


def _common(f: GGUFFile, p: str) -> dict:
    """The config every architecture has: sizes, norms, rope's base, the embedding's tying,
    the token ids, the dtype, where it came from."""
    embed = f.tensor_infos.get("token_embd.weight")
    vocab = f.get(p + "vocab_size", None)
    if vocab is None:
        if embed is None:
            raise GGUFError(f"'{f.path}' has neither {p}vocab_size nor token_embd.weight.")
        vocab = int(embed.shape[-1])
    hf: dict = {
        "hidden_act": "silu",
        "hidden_size": int(f.get(p + "embedding_length")),
        "num_hidden_layers": int(f.get(p + "block_count")),
        "vocab_size": int(vocab),
        "rms_norm_eps": float(f.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(f.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(f.get(p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in f.tensor_infos,
        "mlp_bias": "blk.0.ffn_up.bias" in f.tensor_infos,
        "torch_dtype": checkpoint_dtype(f),
        "engine_source": {"format": "gguf", "file": os.path.basename(f.path),
                          "general.name": f.get("general.name", None)},
    }
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = f.get(f"tokenizer.ggml.{key}", None)
        if value is not None:
            hf[hf_key] = int(value)
    eot = f.get("tokenizer.ggml.eot_token_id", None)  # llama.cpp stops on it too
    if eot is not None and eot != hf.get("eos_token_id"):
        hf["eos_token_id"] = [x for x in (hf.get("eos_token_id"), int(eot)) if x is not None]
    return hf


def _deepseek2(f: GGUFFile) -> dict:
    """A "deepseek2" file's config as DeepSeek's config.json (see the module docstring)."""
    p = "deepseek2."
    hf = _common(f, p)
    layers = hf["num_hidden_layers"]
    rope_dim = int(f.get(p + "rope.dimension_count"))
    kv_lora = int(f.get(p + "attention.kv_lora_rank"))
    if f.has(p + "attention.key_length_mla"):  # the split kv_b (attn_k_b / attn_v_b)
        qk_head = int(f.get(p + "attention.key_length_mla"))
        v_head = int(f.get(p + "attention.value_length_mla"))
    else:  # older files: attn_kv_b whole, key_length the head's own
        qk_head = int(f.get(p + "attention.key_length"))
        v_head = int(f.get(p + "attention.value_length"))
    heads = _uniform(f, p + "attention.head_count")
    gating = int(f.get(p + "expert_gating_func", 1))  # llama.cpp: 1 softmax, 2 sigmoid
    if gating not in (1, 2):
        raise GGUFError(f"'{f.path}': {p}expert_gating_func is {gating}; DeepSeek's experts are "
                        f"gated by softmax (1, V2) or sigmoid (2, V3).")
    v3 = gating == 2
    groups = int(f.get(p + "expert_group_count", 1) or 1)
    hf.update({
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": _uniform(f, p + "feed_forward_length"),
        "q_lora_rank": int(f.get(p + "attention.q_lora_rank")) if
        f.has(p + "attention.q_lora_rank") else None,
        "kv_lora_rank": kv_lora,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_head - rope_dim,
        "v_head_dim": v_head,
        "rope_interleave": True,  # llama.cpp rotates adjacent pairs (its rope type "norm")
        "attention_bias": "blk.0.attn_output.bias" in f.tensor_infos,
    })
    if f.has(p + "expert_count"):
        experts = int(f.get(p + "expert_count"))
        first_dense = int(f.get(p + "leading_dense_block_count", 0))
        if first_dense < layers and f"blk.{first_dense}.ffn_gate_exps.weight" not in \
                f.tensor_infos:
            raise GGUFError(f"'{f.path}': {p}expert_count is set but layer {first_dense} "
                            f"(the first after {p}leading_dense_block_count) has no expert "
                            f"tensors (blk.{first_dense}.ffn_gate_exps.weight).")
        hf.update({
            "n_routed_experts": experts,
            "num_experts_per_tok": int(f.get(p + "expert_used_count")),
            "moe_intermediate_size": int(f.get(p + "expert_feed_forward_length")),
            "n_shared_experts": int(f.get(p + "expert_shared_count", 0)),
            "first_k_dense_replace": first_dense,
            "routed_scaling_factor": float(f.get(p + "expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(f.get(p + "expert_weights_norm", False)),
            "scoring_func": "sigmoid" if v3 else "softmax",
            "topk_method": "noaux_tc" if v3 else
            ("group_limited_greedy" if groups > 1 else "greedy"),
            "n_group": groups,
            "topk_group": int(f.get(p + "expert_group_used_count", 1) or 1),
        })
    kind = f.get(p + "rope.scaling.type", "none")
    if kind == "yarn":
        mscale = float(f.get(p + "rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        hf["rope_scaling"] = {
            "rope_type": "yarn", "factor": float(f.get(p + "rope.scaling.factor")),
            "original_max_position_embeddings":
                int(f.get(p + "rope.scaling.original_context_length")),
            "beta_fast": float(f.get(p + "rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(f.get(p + "rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale, "mscale_all_dim": mscale}
    elif kind not in ("none", None):
        raise GGUFError(f"'{f.path}': {p}rope.scaling.type '{kind}' is not supported for "
                        f"deepseek2 (supported: none, yarn).")
    return hf


def _experts(f: GGUFFile, p: str, layers: int, mixtral: bool) -> dict:
    """A mixture of experts' config, as llama.cpp converts and runs it: Mixtral (every layer
    sparse, experts of feed_forward_length), Qwen3-MoE (the top-k weights always renormalized;
    a layer is sparse where the file stacks its experts)."""
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in f.tensor_infos]
    if len(dense) == layers or (mixtral and dense):
        raise GGUFError(f"'{f.path}': {p}expert_count is set but layer {dense[0]} has no "
                        f"expert tensors (blk.{dense[0]}.ffn_gate_exps.weight)"
                        f"{': a Mixtral file has them in every layer' if mixtral else ''}.")
    experts = int(f.get(p + "expert_count"))
    top_k = {"num_experts_per_tok": int(f.get(p + "expert_used_count"))}
    if mixtral:
        return {"num_local_experts": experts, **top_k, "sliding_window": None}
    return {"num_experts": experts, **top_k,
            "moe_intermediate_size": int(f.get(p + "expert_feed_forward_length")),
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": dense}


def _uniform(f: GGUFFile, key: str, default: Any = MISSING) -> int:
    value = f.get(key, default)
    if isinstance(value, list):  # per-layer values: we support only uniform ones
        if len(set(value)) != 1:
            raise GGUFError(f"'{f.path}': {key} differs between layers ({value[:8]}...); "
                            f"only uniform layers are supported.")
        value = value[0]
    return int(value)


def _rope_scaling(f: GGUFFile, p: str, head_dim: int) -> dict | None:
    kind = f.get(p + "rope.scaling.type", "none")
    if ROPE_FREQS in f.tensor_infos:  # Llama 3.1 ships its factors as a tensor
        factors = f.array(f.tensor_infos[ROPE_FREQS]).reshape(-1)
        if len(factors) != head_dim // 2:
            raise GGUFError(f"'{f.path}': tensor '{ROPE_FREQS}' has {len(factors)} "
                            f"values; heads of {head_dim} dimensions need {head_dim // 2}.")
        return {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}
    if kind in ("none", None):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(f.get(p + "rope.scaling.factor"))}
    raise GGUFError(f"'{f.path}': {p}rope.scaling.type '{kind}' is not supported "
                    f"(supported: none, linear, and Llama 3's {ROPE_FREQS}).")
