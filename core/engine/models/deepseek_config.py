"""DeepSeek-V2/V3's config fields: multi-head latent attention (``MLAConfig``) and the routing
of their mixture of experts (``GroupedRouting``), read from an HF config.json as transformers
reads them, with what neither transformers nor DeepSeek's own code defines refused by name.

Where transformers and DeepSeek's code read a field differently, the engine follows
transformers (the reference it is proven against) and refuses the values on which they would
disagree: DeepseekV2 with ``norm_topk_prob`` true (transformers ignores it; DeepSeek's V2 code
renormalizes and then skips ``routed_scaling_factor``; every published V2 checkpoint sets it
false). ``moe_layer_freq``, which transformers ignores (every published checkpoint has 1), is
honoured as DeepSeek's code and SGLang do: layer i is sparse when i >= first_k_dense_replace
and i % moe_layer_freq == 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import EngineError

MLA_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# what each architecture's code defines (transformers' and DeepSeek's agree on these)
ARCH_ROUTING = {
    "DeepseekV2ForCausalLM": (("softmax",), ("greedy", "group_limited_greedy")),
    "DeepseekV3ForCausalLM": (("sigmoid",), ("noaux_tc",)),
}
DEFAULT_ROUTING = {"DeepseekV2ForCausalLM": ("softmax", "greedy"),
                   "DeepseekV3ForCausalLM": ("sigmoid", "noaux_tc")}


# fmt: off
@dataclass(frozen=True)
class MLAConfig:
    kv_lora_rank: int           # the compressed KV latent (what the pool holds, with the rope key)
    q_lora_rank: int | None     # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    qk_nope_head_dim: int       # a head's query/key dimensions without position
    qk_rope_head_dim: int       # ... and with rotary position (one rope key shared by the heads)
    v_head_dim: int
    rope_interleave: bool       # rope dims in pairs (x0, x1), (x2, x3): V2 always, V3 by default
    softmax_scale: float        # qk_head_dim ** -0.5, times yarn's mscale ** 2
    attention_bias: bool        # q_a_proj, kv_a_proj_with_mqa and o_proj carry a bias
# fmt: on

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the KV pool."""
        return self.kv_lora_rank + self.qk_rope_head_dim


# fmt: off
@dataclass(frozen=True)
class GroupedRouting:
    scoring: str                # "softmax" or "sigmoid" (scoring_func)
    topk_method: str            # TOPK_METHODS
    n_group: int                # expert groups (1: no grouping)
    topk_group: int             # groups a token may pick its experts from
    routed_scaling_factor: float
    n_shared_experts: int       # one MLP of n_shared * moe_intermediate_size every token runs
    first_k_dense_replace: int  # layers before this one are dense
    moe_layer_freq: int
# fmt: on

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """DeepSeek's softmax scale: qk_head_dim ** -0.5, times mscale ** 2 with yarn's
    ``mscale_all_dim`` (transformers' yarn_apply_mscale)."""
    scale = qk_head_dim ** -0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        m = yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
        scale *= m * m
    return scale


def _int(hf: dict, key: str, source: str, low: int = 1) -> int:
    v = hf.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise EngineError(f"{key} is {v!r} in {source}; DeepSeek's MLA and MoE need an integer "
                          f">= {low} there.")
    return v


def mla_fields(hf: dict, arch: str, rope_scaling: dict | None, source: str) -> dict:
    """ModelConfig fields of a DeepSeek-V2/V3 config.json: ``mla``, ``routing`` and the MoE
    fields the other MoE models share (num_experts, ...), plus ``head_dim`` (the rotary
    dimensions, which the model's rotary embedding is built for)."""
    if hf.get("mlp_bias"):
        raise EngineError(f"{source} sets mlp_bias for {arch}; no published DeepSeek checkpoint "
                          f"has MLP biases and the engine's experts carry none.")
    q_lora = hf.get("q_lora_rank")
    if q_lora is not None:
        q_lora = _int(hf, "q_lora_rank", source)
    nope, rope = _int(hf, "qk_nope_head_dim", source), _int(hf, "qk_rope_head_dim", source)
    if rope % 2:
        raise EngineError(f"qk_rope_head_dim is {rope} in {source}; rotary dimensions come in "
                          f"pairs, so it must be even.")
    mla = MLAConfig(
        kv_lora_rank=_int(hf, "kv_lora_rank", source), q_lora_rank=q_lora,
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=_int(hf, "v_head_dim", source),
        # transformers' V2 rotates interleaved pairs (complex numbers); V3 as rope_interleave
        rope_interleave=(arch == "DeepseekV2ForCausalLM" or
                         bool(hf.get("rope_interleave", True))),
        softmax_scale=softmax_scale(nope + rope, rope_scaling),
        attention_bias=bool(hf.get("attention_bias", False)))
    return {"mla": mla, "head_dim": rope, **_moe_fields(hf, arch, source)}


def _moe_fields(hf: dict, arch: str, source: str) -> dict:
    experts = hf.get("n_routed_experts", hf.get("num_local_experts")) or 0
    if not experts:  # every layer dense
        return {}
    scoring_default, method_default = DEFAULT_ROUTING[arch]
    scoring = hf.get("scoring_func") or scoring_default
    method = hf.get("topk_method") or method_default
    scorings, methods = ARCH_ROUTING[arch]
    if scoring not in scorings or method not in methods:
        raise EngineError(
            f"{source} asks {arch} for scoring_func {scoring!r} with topk_method {method!r}; "
            f"its code defines scoring_func {' / '.join(scorings)} with topk_method "
            f"{' / '.join(methods)} only (transformers and DeepSeek's own).")
    norm = bool(hf.get("norm_topk_prob", False))
    if arch == "DeepseekV2ForCausalLM" and norm:
        raise EngineError(
            f"{source} sets norm_topk_prob true for DeepseekV2, which transformers ignores and "
            f"DeepSeek's V2 code reads as 'renormalize, without routed_scaling_factor': the "
            f"two disagree, so the engine refuses to guess. Published V2 checkpoints set it "
            f"false; set it false to get transformers' routing.")
    top_k = _int(hf, "num_experts_per_tok", source)
    grouped = method != "greedy"
    n_group = _int(hf, "n_group", source) if grouped else 1
    topk_group = _int(hf, "topk_group", source) if grouped else 1
    per_group = experts // n_group
    if experts % n_group or topk_group > n_group or top_k > topk_group * per_group or \
            (method == "noaux_tc" and per_group < 2):
        raise EngineError(
            f"{source} gives {experts} experts in n_group {n_group} groups, topk_group "
            f"{topk_group} and num_experts_per_tok {top_k}: the groups must split the experts "
            f"evenly (noaux_tc: at least 2 per group, its group score is the top-2 sum), "
            f"topk_group <= n_group, and the picked groups must hold num_experts_per_tok "
            f"experts.")
    routing = GroupedRouting(
        scoring=scoring, topk_method=method, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_shared_experts=hf.get("n_shared_experts") or 0,
        first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
        moe_layer_freq=_int({"moe_layer_freq": hf.get("moe_layer_freq", 1)}, "moe_layer_freq",
                            source))
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": _int(hf, "moe_intermediate_size", source),
            "norm_topk_prob": norm, "routing": routing}
