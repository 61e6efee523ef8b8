"""ModelConfig: the fields of a Hugging Face config.json that the Llama family, its
mixture-of-experts relatives (Qwen3-MoE, Mixtral) and DeepSeek-V2/V3 (deepseek_config.py: MLA
and grouped routing) need."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import EngineError
from engine.interfaces import AttentionLayerSpec
from engine.models.deepseek_config import MLA_ARCHS, GroupedRouting, MLAConfig, mla_fields

# "freq_factors" is ours: explicit per-frequency divisors, read from a GGUF's rope_freqs tensor
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn")
YARN_ARCHS = MLA_ARCHS  # yarn (and its mscale) is implemented and proven for DeepSeek's only
# architectures whose attention projections always carry a bias, whatever attention_bias says
QKV_BIAS_ARCHS = ("Qwen2ForCausalLM",)
QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# mixture-of-experts architectures (models/moe.py); their HF routing differs in two points:
# whether the top-k weights are renormalized (Mixtral: always) and in which dtype they weight
# the experts' outputs (Qwen3-MoE casts them to the model's dtype, Mixtral keeps float32)
MOE_ARCHS = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


# fmt: off
@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None        # {"rope_type": "linear"|"llama3", ...}; None: plain
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()  # the layers that use sliding_window
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False                   # RMSNorm over head_dim on q and k before rope
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None          # the checkpoint's dtype name, e.g. "bfloat16"
    # mixture of experts (MOE_ARCHS; num_experts 0: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0            # top-k experts per token
    moe_intermediate_size: int = 0          # one expert's intermediate size
    norm_topk_prob: bool = False            # renormalize the top-k weights to sum to 1
    decoder_sparse_step: int = 1            # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()   # ... and it is not listed here (dense MLP)
    # DeepSeek-V2/V3 (MLA_ARCHS): multi-head latent attention, whose head_dim above is the
    # rotary dimensions (qk_rope_head_dim); and their routing (None: a dense model)
    mla: MLAConfig | None = None
    routing: GroupedRouting | None = None
    hf_config: dict = field(default_factory=dict, repr=False)
# fmt: on

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` routes tokens to experts (else it has the dense MLP), as
        transformers' Qwen3-MoE decides it (Mixtral: every layer; DeepSeek: its routing's
        first_k_dense_replace and moe_layer_freq)."""
        if self.routing is not None:
            return self.num_experts > 0 and self.routing.is_moe_layer(layer)
        return self.num_experts > 0 and layer not in self.mlp_only_layers and \
            (layer + 1) % self.decoder_sparse_step == 0

    def layer_specs(self) -> list[AttentionLayerSpec]:
        if self.mla is not None:  # one latent row per token: the latent, then the rope key
            m = self.mla
            return [AttentionLayerSpec(self.num_heads, 1, m.latent_dim, m.softmax_scale,
                                       kv_lora_rank=m.kv_lora_rank,
                                       qk_nope_head_dim=m.qk_nope_head_dim)
                    for _ in range(self.num_layers)]
        windowed = set(self.sliding_window_layers)
        return [
            AttentionLayerSpec(self.num_heads, self.num_kv_heads, self.head_dim,
                               scaling=self.head_dim ** -0.5,
                               sliding_window=self.sliding_window if i in windowed else None)
            for i in range(self.num_layers)
        ]

    @classmethod
    def from_checkpoint(cls, ckpt, models_registry=None) -> "ModelConfig":
        """From a models.checkpoint.Checkpoint (an HF directory or a GGUF file)."""
        return cls.from_hf(ckpt.hf_config, models_registry, source=ckpt.config_source)

    @classmethod
    def from_hf(cls, hf: dict, models_registry=None, source: str = "config.json") -> "ModelConfig":
        """Parse an HF config dict; ``models_registry`` (a Registry) lists what is supported."""
        archs = hf.get("architectures") or []
        if not archs:
            raise EngineError(f"{source} names no 'architectures'; cannot tell which model it is.")
        arch = archs[0]
        if models_registry is not None and arch not in models_registry:
            raise EngineError(
                f"Unsupported model architecture '{arch}' ({source}). "
                f"Supported architectures: {', '.join(models_registry.names()) or 'none'}.")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise EngineError(f"Unsupported hidden_act '{act}' in {source} (only silu).")
        heads = hf["num_attention_heads"]
        layers = hf["num_hidden_layers"]
        window, window_layers = _sliding_window(hf, arch, layers)
        theta, scaling = _rope(hf, source, arch)
        mla = mla_fields(hf, arch, scaling, source) if arch in MLA_ARCHS else {}
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        qk_norm = arch in QK_NORM_ARCHS
        attn_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            hidden_size=hf["hidden_size"],
            num_layers=layers,
            num_heads=heads,
            # MLA: the heads share one latent; num_key_value_heads means nothing there
            num_kv_heads=heads if mla else hf.get("num_key_value_heads") or heads,
            head_dim=mla.pop("head_dim", None) or hf.get("head_dim") or
            hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=window,
            sliding_window_layers=window_layers,
            qkv_bias=attn_bias or arch in QKV_BIAS_ARCHS,
            o_bias=attn_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=qk_norm,
            eos_token_ids=eos,
            bos_token_id=hf.get("bos_token_id"),
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            hf_config=hf,
            **_moe(hf, arch, layers, source),
            **mla,
        )


def _sliding_window(hf: dict, arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """Which layers attend through a window, as transformers decides it."""
    window = hf.get("sliding_window")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        # transformers' Mistral (and Mixtral) passes config.sliding_window to every layer
        return (window, tuple(range(num_layers))) if window else (None, ())
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # transformers drops the window unless use_sliding_window, then derives layer_types
        # (when the file has none) as "sliding from layer max_window_layers on"
        if not hf.get("use_sliding_window", False) or not window:
            return None, ()
        types = hf.get("layer_types")
        if types is None:
            first = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention"
                     for i in range(num_layers)]
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        return (window, layers) if layers else (None, ())
    if arch == "Qwen3MoeForCausalLM":  # every layer, when use_sliding_window
        use = hf.get("use_sliding_window", False) and window
        return (window, tuple(range(num_layers))) if use else (None, ())
    return None, ()  # transformers' Llama has no sliding window


def _moe(hf: dict, arch: str, num_layers: int, source: str) -> dict:
    """The mixture-of-experts fields of an MOE_ARCHS config (router aux-loss fields are
    training's and ignored)."""
    if arch not in MOE_ARCHS:
        return {}
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (Mixtral's name)
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    top_k = hf.get("num_experts_per_tok")
    if arch == "MixtralForCausalLM":  # every layer sparse, experts of intermediate_size
        fields = dict(moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
    else:
        step = hf.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise EngineError(f"decoder_sparse_step is {step!r} in {source}; it must be an "
                              f"integer >= 1.")
        fields = dict(moe_intermediate_size=hf.get("moe_intermediate_size"),
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                      decoder_sparse_step=step,
                      mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
    if experts and (not top_k or not 0 < top_k <= experts or not fields["moe_intermediate_size"]):
        raise EngineError(f"{source} gives {experts} experts, num_experts_per_tok {top_k!r} and "
                          f"an expert intermediate size {fields['moe_intermediate_size']!r}: "
                          f"expected 1 <= num_experts_per_tok <= the experts and a size.")
    bad = [i for i in fields.get("mlp_only_layers", ()) if not 0 <= i < num_layers]
    if bad:
        raise EngineError(f"mlp_only_layers lists {bad} in {source}: the model has layers "
                          f"0..{num_layers - 1}.")
    return dict(num_experts=experts or 0, num_experts_per_tok=top_k or 0, **fields)


def _rope(hf: dict, source: str, arch: str = "") -> tuple[float, dict | None]:
    # transformers 5 writes "rope_parameters" (theta inside), older ones rope_theta + rope_scaling
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    types = ROPE_TYPES if arch in YARN_ARCHS else tuple(t for t in ROPE_TYPES if t != "yarn")
    if rope_type not in types:
        yarn = (f"; yarn for {' and '.join(YARN_ARCHS)} only" if rope_type == "yarn" else "")
        raise EngineError(f"Unsupported rope scaling type '{rope_type}' in {source} for "
                          f"{arch or 'this model'} (supported: {', '.join(types)}{yarn}).")
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if rope_type == "yarn":
        if not params.get("original_max_position_embeddings"):
            raise EngineError(f"yarn rope scaling in {source} gives no "
                              f"original_max_position_embeddings (the pretrained context).")
        if params.get("factor") is None:  # transformers: the context's growth
            params["factor"] = hf["max_position_embeddings"] / \
                params["original_max_position_embeddings"]
    return theta, params
