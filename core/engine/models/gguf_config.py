"""A GGUF's metadata as the HF config.json dict ModelConfig.from_hf reads: the architecture,
the sizes (uniform layers only), rope (linear scaling, or Llama 3's per-frequency factors
tensor), the token ids, and the dtype the weights count as."""

from __future__ import annotations

import os
from typing import Any

from engine.models.gguf import MISSING, ROPE_FREQS, GGUFError, GGUFFile, gguf_package

# general.architecture -> the HF architecture our model registry knows. Mistral's GGUFs say
# "llama" (llama.cpp converts MistralForCausalLM as a Llama, without a sliding window).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
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
            f"Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE).")
    p = f"{arch}."
    hidden = int(f.get(p + "embedding_length"))
    heads = _uniform(f, p + "attention.head_count")
    kv_heads = _uniform(f, p + "attention.head_count_kv", heads)
    head_dim = int(f.get(p + "attention.key_length", hidden // heads))
    rope_dim = int(f.get(p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"'{f.path}': {p}rope.dimension_count is {rope_dim} but heads have "
                        f"{head_dim} dimensions; partial rotary embeddings are not supported.")
    embed = f.tensor_infos.get("token_embd.weight")
    vocab = f.get(p + "vocab_size", None)
    if vocab is None:
        if embed is None:
            raise GGUFError(f"'{f.path}' has neither {p}vocab_size nor token_embd.weight.")
        vocab = int(embed.shape[-1])
    mixtral = arch == "llama" and f.has(p + "expert_count")
    hf: dict = {
        "architectures": [MIXTRAL if mixtral else ARCHITECTURES[arch]],
        "model_type": "mixtral" if mixtral else MODEL_TYPES.get(arch, arch),
        "hidden_act": "silu",
        "hidden_size": hidden,
        # a MoE file with no dense layer may leave it out: its experts' size stands in
        "intermediate_size": _uniform(f, p + "feed_forward_length"
                                      if f.has(p + "feed_forward_length")
                                      else p + "expert_feed_forward_length"),
        "num_hidden_layers": int(f.get(p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "rms_norm_eps": float(f.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(f.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(f.get(p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in f.tensor_infos,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in f.tensor_infos,
        "mlp_bias": "blk.0.ffn_up.bias" in f.tensor_infos,
        "torch_dtype": checkpoint_dtype(f),
        "engine_source": {"format": "gguf", "file": os.path.basename(f.path),
                          "general.name": f.get("general.name", None)},
    }
    if f.has(p + "expert_count"):
        hf.update(_experts(f, p, hf["num_hidden_layers"], mixtral))
    rope = _rope_scaling(f, p, head_dim)
    if rope is not None:
        hf["rope_scaling"] = rope
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = f.get(f"tokenizer.ggml.{key}", None)
        if value is not None:
            hf[hf_key] = int(value)
    eot = f.get("tokenizer.ggml.eot_token_id", None)  # llama.cpp stops on it too
    if eot is not None and eot != hf.get("eos_token_id"):
        hf["eos_token_id"] = [x for x in (hf.get("eos_token_id"), int(eot)) if x is not None]
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
