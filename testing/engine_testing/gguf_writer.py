"""For tests and benchmarks: write a GGUF file from a Hugging Face checkpoint the way llama.cpp's
``convert_hf_to_gguf.py`` does (its tensor names, its Q/K row permutation for "llama", Llama 3's
rope factors as a ``rope_freqs`` tensor, the tokenizer as ``tokenizer.ggml.*`` metadata), with
the ``gguf`` package's writer and quantizers.

Written independently of ``engine.models.gguf`` (the reader), so that a test of one against the
other, or against transformers' own GGUF loader, can catch a mistake in either direction."""

from __future__ import annotations

import json
import math
import os

import numpy as np

# HF name pieces -> llama.cpp's, as its converter writes them
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
          "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
PER_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    # DeepSeek-V2/V3 (llama.cpp's deepseek2): MLA's projections, the shared experts
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe",
        "MixtralForCausalLM": "llama", "DeepseekV2ForCausalLM": "deepseek2",
        "DeepseekV3ForCausalLM": "deepseek2"}
# a sparse layer's experts: each projection of every expert stacked in one
# [experts, out, in] tensor (llama.cpp's *_exps); Qwen3-MoE's names, then Mixtral's
EXPERT_STACKS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "down_proj": "ffn_down_exps", "w1": "ffn_gate_exps", "w3": "ffn_up_exps",
                 "w2": "ffn_down_exps"}
# K-quants have no quantizer in the gguf package: their blocks are filled with random bits and
# these float16 scale fields (byte offsets in a block) set small, so the weights stay tame
K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                   "Q6_K": (208,)}
K_SCALE = {"Q2_K": 4e-4, "Q3_K": 4e-4, "Q4_K": 5e-5, "Q5_K": 2.5e-5, "Q6_K": 1e-5}


def gguf_tensor_name(name: str) -> str:
    if name in GLOBAL:
        return GLOBAL[name]
    if name.startswith("blk."):  # written under llama.cpp's name already (deepseek2_tensors)
        return name
    _, _, rest = name.partition("model.layers.")
    layer, _, tail = rest.partition(".")
    module, _, suffix = tail.rpartition(".")
    return f"blk.{layer}.{PER_LAYER[module]}.{suffix}"


def stack_experts(tensors: dict) -> dict:
    """HF's per-expert tensors (model.layers.L.mlp.experts.E.P.weight) replaced by one stacked
    [experts, out, in] array per layer and projection, named as llama.cpp names it
    (blk.L.ffn_P_exps.weight); everything else as it is."""
    out, stacks = {}, {}
    for name, arr in tensors.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            head, sep, tail = name.partition(".block_sparse_moe.experts.")
        if not sep:
            out[name] = arr
            continue
        expert, proj, _ = tail.split(".")
        layer = head.rpartition(".")[2]
        stacks.setdefault(f"blk.{layer}.{EXPERT_STACKS[proj]}.weight", {})[int(expert)] = arr
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


def deepseek2_tensors(tensors: dict, hf: dict) -> dict:
    """DeepSeek's tensors as llama.cpp's converter writes them: kv_b_proj split per head into
    attn_k_b (its nope rows transposed: [heads, kv_lora_rank, nope]) and attn_v_b ([heads,
    v_head_dim, kv_lora_rank]), the gate's e_score_correction_bias as exp_probs_b.bias;
    everything else as it is (named by ``gguf_tensor_name`` later)."""
    heads, nope, v = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["v_head_dim"]
    out = {}
    for name, arr in tensors.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("self_attn.kv_b_proj.weight"):
            kv_b = arr.reshape(heads, nope + v, arr.shape[-1])
            out[f"blk.{layer}.attn_k_b.weight"] = np.ascontiguousarray(
                kv_b[:, :nope].transpose(0, 2, 1))
            out[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:])
        elif name.endswith("mlp.gate.e_score_correction_bias"):
            out[f"blk.{layer}.exp_probs_b.bias"] = arr
        else:
            out[name] = arr
    return out


def add_deepseek2_metadata(w, hf: dict) -> None:
    """deepseek2's keys as llama.cpp's converter writes them: MLA as MQA with one key head of
    kv_lora_rank + rope values (the per-head sizes in the *_mla keys), the experts, routing
    and yarn."""
    import gguf

    rope, kv_lora = hf["qk_rope_head_dim"], hf["kv_lora_rank"]
    w.add_head_count_kv(1)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(hf["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(hf["v_head_dim"])
    w.add_rope_dimension_count(rope)
    w.add_kv_lora_rank(kv_lora)
    if hf.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hf["q_lora_rank"])
    w.add_leading_dense_block_count(hf.get("first_k_dense_replace") or 0)
    w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    w.add_expert_count(hf["n_routed_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_shared_count(hf.get("n_shared_experts") or 0)
    if hf.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(hf["routed_scaling_factor"])
    if hf.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    v3 = hf["architectures"][0] == "DeepseekV3ForCausalLM"
    scoring = hf.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if scoring == "sigmoid"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    if hf.get("n_group") is not None:
        w.add_expert_group_count(hf["n_group"])
    if hf.get("topk_group") is not None:
        w.add_expert_group_used_count(hf["topk_group"])
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if params.get(key) is not None:
                add(params[key])
        if params.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows: per head, (half, pair) -> (pair, half)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(rs: dict, dim: int, base: float) -> np.ndarray:
    """What llama.cpp stores as rope_freqs for a Llama 3.1 rope scaling ``rs``."""
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / base ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _encode(gguf, arr: np.ndarray, qtype: str, rng: np.random.Generator):
    """(data, raw type) for one 2-D weight; rows that a block does not divide stay F32."""
    Q = gguf.GGMLQuantizationType
    q = Q[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    if q == Q.F32 or arr.shape[-1] % block:
        return arr.astype(np.float32), Q.F32
    if q == Q.F16:
        return arr.astype(np.float16), Q.F16
    if qtype in K_SCALE_OFFSETS:
        blocks = rng.integers(0, 256, (arr.shape[0], arr.shape[1] // block, size), dtype=np.uint8)
        for off in K_SCALE_OFFSETS[qtype]:
            blocks[..., off:off + 2] = np.frombuffer(
                np.float16(K_SCALE[qtype]).tobytes(), dtype=np.uint8)
        return blocks.reshape(arr.shape[0], -1), q
    return gguf.quants.quantize(arr.astype(np.float32), q), q


def write_gguf(hf_dir: str, out_path: str, qtype: str = "F32", *, tokenizer: bool = True,
               architecture: str | None = None, seed: int = 0) -> str:
    """Convert the HF checkpoint in ``hf_dir`` (config.json, model.safetensors, tokenizer.json)
    into ``out_path``; 2-D weights in ``qtype`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    Q2_K..Q6_K), norms in F32. ``architecture`` overrides general.architecture (for tests of
    unsupported ones); ``tokenizer=False`` leaves the tokenizer metadata out."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    arch = architecture or ARCH[hf["architectures"][0]]
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or \
        hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(os.path.basename(hf_dir.rstrip("/")))
    w.add_file_type(int(gguf.LlamaFileType[_file_type(qtype)]))
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf.get("max_position_embeddings", 2048))
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    deepseek = arch == "deepseek2"
    if deepseek:
        add_deepseek2_metadata(w, hf)
    else:
        w.add_head_count_kv(kv_heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(hf.get("rms_norm_eps", 1e-6))
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    w.add_rope_freq_base(theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "linear" and not deepseek:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(params["factor"])
    w.add_vocab_size(hf["vocab_size"])
    experts = hf.get("num_experts") or hf.get("num_local_experts")  # transformers 5: the latter
    if experts and not deepseek:  # as llama.cpp's converters write Qwen3-MoE and Mixtral
        w.add_expert_count(experts)
        w.add_expert_used_count(hf["num_experts_per_tok"])
        if "moe_intermediate_size" in hf:  # Mixtral's experts are feed_forward_length wide
            w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    if tokenizer:
        _add_tokenizer(w, hf_dir)

    rng = np.random.default_rng(seed)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    if rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(params, head_dim, theta))
    if deepseek:
        tensors = deepseek2_tensors(tensors, hf)
    tensors = stack_experts(tensors)
    for name, arr in tensors.items():
        if hf.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        arr = arr.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = permute_rows(arr, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = permute_rows(arr, kv_heads)
        if arr.ndim == 3:  # experts stacked: each expert's rows encoded as a 2-D weight's
            data, raw = _encode(gguf, arr.reshape(-1, arr.shape[-1]), qtype, rng)
            w.add_tensor(name, data.reshape(arr.shape[0], arr.shape[1], -1), raw_dtype=raw)
        elif arr.ndim == 2:
            data, raw = _encode(gguf, arr, qtype, rng)
            w.add_tensor(gguf_tensor_name(name), data, raw_dtype=raw)
        else:
            w.add_tensor(gguf_tensor_name(name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _file_type(qtype: str) -> str:
    return {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16",
            "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M", "Q3_K": "MOSTLY_Q3_K_M",
            "Q2_K": "MOSTLY_Q2_K"}.get(qtype, f"MOSTLY_{qtype}")


def _add_tokenizer(w, hf_dir: str) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp writes one ("gpt2"): tokens by id, merges,
    token types (3 = control for the special tokens), special ids, chat template."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    for key, setter in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                        ("pad_token", w.add_pad_token_id)):
        if tok_config.get(key) in special:
            setter(special[tok_config[key]])
    w.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    if tok_config.get("chat_template"):
        w.add_chat_template(tok_config["chat_template"])
