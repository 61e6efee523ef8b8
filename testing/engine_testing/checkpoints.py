"""Tiny checkpoints for tests and benchmarks: a byte-level BPE tokenizer trained offline on text
that ships with Python, and tiny random-init Hugging Face models saved as real checkpoints."""

from __future__ import annotations

import codecs
import contextlib
import functools
import importlib
import inspect
import io
import json
import os

import torch

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS_MODULES = ("os", "json", "re", "collections", "functools", "itertools",
                  "argparse", "logging", "textwrap", "string", "pathlib", "dataclasses",
                  "inspect", "unittest", "subprocess", "shutil", "contextlib", "heapq")
CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig", "MixtralForCausalLM": "MixtralConfig",
    "DeepseekV2ForCausalLM": "DeepseekV2Config", "DeepseekV3ForCausalLM": "DeepseekV3Config",
}


def corpus() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    texts = [codecs.decode(this.s, "rot13")]
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        texts.append(module.__doc__ or "")
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc:
                texts.append(doc)
    return [t for t in texts if t]


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    return tok.to_str()


def train_tokenizer(out_dir: str, vocab_size: int = 512) -> str:
    """Write a byte-level BPE tokenizer (HF PreTrainedTokenizerFast files) into ``out_dir``;
    ids 0, 1, 2 are <s>, </s>, <pad>. Trained once per process and vocab size."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        f.write(_tokenizer_json(vocab_size))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "pad_token": PAD, "add_bos_token": True, "model_max_length": 4096,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, f, indent=2)
    return out_dir

# name -> (architecture, config overrides): the cases the HF-equivalence tests cover
TINY_CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral_window": ("MistralForCausalLM", {"sliding_window": 12}),
    "qwen2_bias_window": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 12,
                                               "max_window_layers": 1}),
    "qwen3_qk_norm": ("Qwen3ForCausalLM", {}),
    "llama_tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3_rope": ("LlamaForCausalLM", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
}

# the mixture-of-experts cases (engine/models/moe.py), with their awkward corners: dense layers
# by decoder_sparse_step and by mlp_only_layers, top-k weights renormalized or not, an odd k,
# Mixtral's top-2 with a sliding window. Kept apart from TINY_CASES, whose tests also take
# every case through the piecewise CUDA graphs, which MoE models refuse (tests/test_moe*.py
# take these through the same HF comparisons and the engine's whole path);
# ``tiny_model_factory(arch, **overrides)`` builds one.
MOE_CASES = {
    # 3 layers: 0 and 2 sparse, 1 dense (mlp_only_layers); top-3 of 8, renormalized
    "qwen3_moe_mlp_only": ("Qwen3MoeForCausalLM", {
        "num_hidden_layers": 3, "mlp_only_layers": [1], "decoder_sparse_step": 1,
        "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": True}),
    # 4 layers: 1 and 3 sparse, 0 and 2 dense (decoder_sparse_step 2); top-4 of 8, raw weights
    "qwen3_moe_sparse_step": ("Qwen3MoeForCausalLM", {
        "num_hidden_layers": 4, "decoder_sparse_step": 2, "num_experts": 8,
        "num_experts_per_tok": 4, "norm_topk_prob": False}),
    "mixtral_window": ("MixtralForCausalLM", {
        "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 16}),
}


# DeepSeek-V2/V3 (engine/models/deepseek.py: MLA + DeepSeek's routing) with their corners: q
# LoRA or q_proj, yarn with mscale != mscale_all_dim (cos/sin scaled, softmax scale corrected)
# or plain rope, interleaved rope or not (V3), softmax greedy / group-limited and sigmoid
# noaux_tc routing (a random correction bias), shared experts, routed_scaling_factor,
# norm_topk_prob, first_k_dense_replace, an attention bias; v_head_dim != qk_nope_head_dim
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 1.0}
DEEPSEEK_CASES = {
    # V2-Lite-like: no q LoRA, greedy softmax top-2 of 8, 2 shared experts, first layer dense
    "v2_lite_greedy": ("DeepseekV2ForCausalLM", {
        "q_lora_rank": None, "topk_method": "greedy", "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 2, "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0, "num_hidden_layers": 3, "rope_parameters": YARN}),
    # V2-like: q LoRA, group-limited greedy (4 groups, 2 picked), top-3, scaled, attention bias
    "v2_group_limited": ("DeepseekV2ForCausalLM", {
        "q_lora_rank": 48, "topk_method": "group_limited_greedy", "n_group": 4,
        "topk_group": 2, "n_routed_experts": 8, "num_experts_per_tok": 3,
        "n_shared_experts": 1, "routed_scaling_factor": 1.5, "attention_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    # V3-like: q LoRA, sigmoid noaux_tc with the bias, renormalized, x2.5, yarn, interleaved
    "v3_noaux_tc": ("DeepseekV3ForCausalLM", {
        "q_lora_rank": 48, "n_group": 4, "topk_group": 2, "n_routed_experts": 16,
        "num_experts_per_tok": 4, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "first_k_dense_replace": 1, "num_hidden_layers": 3,
        "rope_parameters": YARN}),
    # V3 without q LoRA, rope halves (rope_interleave false), raw sigmoid weights
    "v3_no_lora_halves": ("DeepseekV3ForCausalLM", {
        "q_lora_rank": None, "n_group": 2, "topk_group": 1, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 2, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "first_k_dense_replace": 0, "rope_interleave": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def tiny_config_kwargs(arch: str, vocab_size: int = 512) -> dict:
    kw = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.08, rms_norm_eps=1e-6,
              bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        kw["head_dim"] = 48  # != hidden/heads, as in real Qwen3 checkpoints
    if arch == "Qwen3MoeForCausalLM":
        kw["moe_intermediate_size"] = 64  # the experts' (the dense layers': intermediate_size)
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        # MLA: the latent (32) + the rope key (16) per token; heads of 24 + 16, values of 20
        kw.update(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=24,
                  qk_rope_head_dim=16, v_head_dim=20, moe_intermediate_size=48)
    return kw


def make_tiny_model(out_dir: str, arch: str = "LlamaForCausalLM", *, seed: int = 0,
                    save_dtype: torch.dtype = torch.float32, **config_overrides) -> str:
    """Save a random-init HF ``arch`` checkpoint (safetensors + tokenizer) in ``out_dir``."""
    import transformers

    kw = {**tiny_config_kwargs(arch, config_overrides.pop("vocab_size", 512)), **config_overrides}
    config = getattr(transformers, CONFIG_CLASSES[arch])(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    # HF initializes norms to 1 and biases to 0; perturb them so loading them is tested
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * config.initializer_range)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():  # DeepSeek-V3's noaux_tc correction bias
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    model.to(save_dtype).save_pretrained(out_dir, safe_serialization=True)
    train_tokenizer(out_dir, config.vocab_size)
    return out_dir
