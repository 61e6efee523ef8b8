"""ModelConfig: the fields of a Hugging Face config.json that the Llama family needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import EngineError
from engine.interfaces import AttentionLayerSpec

# "freq_factors" is ours: explicit per-frequency divisors, read from a GGUF's rope_freqs tensor
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")
# architectures whose attention projections always carry a bias, whatever attention_bias says
QKV_BIAS_ARCHS = ("Qwen2ForCausalLM",)
QK_NORM_ARCHS = ("Qwen3ForCausalLM",)


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
    hf_config: dict = field(default_factory=dict, repr=False)
# fmt: on

    def layer_specs(self) -> list[AttentionLayerSpec]:
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
        theta, scaling = _rope(hf, source)
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        qk_norm = arch in QK_NORM_ARCHS
        attn_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            hidden_size=hf["hidden_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
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
        )


def _sliding_window(hf: dict, arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """Which layers attend through a window, as transformers decides it."""
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM":
        # transformers' Mistral passes config.sliding_window to every layer
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
    return None, ()  # transformers' Llama has no sliding window


def _rope(hf: dict, source: str) -> tuple[float, dict | None]:
    # transformers 5 writes "rope_parameters" (theta inside), older ones rope_theta + rope_scaling
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise EngineError(f"Unsupported rope scaling type '{rope_type}' in {source} "
                          f"(supported: {', '.join(ROPE_TYPES)}).")
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return theta, params
