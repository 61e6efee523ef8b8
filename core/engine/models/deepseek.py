"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (layers/mla.py: the KV pool holds
the compressed latent and the rope key, one row per token and layer) and a mixture of experts
with shared experts and DeepSeek's routing (layers/moe_routing.py, through layers/moe.py's
``SparseMoE``) where ``first_k_dense_replace`` and ``moe_layer_freq`` say, llama.py's dense MLP
elsewhere. The embedding, rotary tables (the rope dimensions, with yarn), final norm and head
are llama.py's. Checkpoint names are HF's: ``self_attn.{q_proj | q_a_proj, q_a_layernorm,
q_b_proj}``, ``self_attn.kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``;
``mlp.gate.weight`` (+ ``e_score_correction_bias`` with noaux_tc), ``mlp.experts.{i}.*`` and
``mlp.shared_experts.*``.

Not yet (issue 31's later parts), each refused with its reason: tensor, expert and pipeline
parallelism; CUDA graphs and piecewise CUDA graphs; the CPU graph; attention backends without
MLA (``register_attention_backends(mla=True)``: torch_native, and triton on a CUDA GPU)."""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import EngineError
from engine.interfaces import GraphUnsupported
from engine.layers.mla import MLAttention
from engine.layers.moe import Expert, SparseMoE
from engine.layers.moe_routing import GroupedTopKRouter
from engine.layers.norm import RMSNorm
from engine.models.config import ModelConfig
from engine.models.llama import MLP, LlamaForCausalLM
from engine.parallel.group import TPGroup

CUDA_GRAPH_REASON = ("DeepSeek models are not captured yet: MoE layers read their per-expert "
                     "token counts on the host, and MLA decode steps have not run in a captured "
                     "graph on a GPU (the fused MoE kernel and that proof are issue 31's later "
                     "parts)")
CPU_GRAPH_REASON = "MLA attention and MoE layers have no CPU graph nodes yet"


class DeepseekMoE(SparseMoE):
    """The routed experts (DeepSeek's routing, float32 weights as transformers') plus the
    shared experts every token runs, summed."""

    def __init__(self, config: ModelConfig):
        c, r = config, config.routing
        super().__init__(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                         c.num_experts_per_tok, c.norm_topk_prob, float32_weights=True,
                         gate=GroupedTopKRouter(c.hidden_size, c.num_experts, r))
        if r.n_shared_experts:
            self.shared_experts = Expert(c.hidden_size,
                                         c.moe_intermediate_size * r.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.shared_experts(x) if hasattr(self, "shared_experts") else out


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup | None = None,
                 global_id: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DeepseekMoE(config) if config.is_moe_layer(layer_id) else MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


def parallel_problem(config: ModelConfig, tp_size: int, pp_size: int,
                     ep_size: int = 1) -> str | None:
    """Why ``config`` cannot be served over ``tp_size`` x ``pp_size`` ranks (None: it can)."""
    if tp_size * pp_size == 1:
        return None
    return (f"{config.architecture} (multi-head latent attention"
            f"{f', {config.num_experts} experts' if config.num_experts else ''}) is served in "
            f"one process for now: --tp-size does not split its latent attention or experts, "
            f"expert parallelism (--ep-size, issue 31) is not available yet, nor are --pp-size "
            f"stages for it. Serve it with --tp-size 1 --pp-size 1.")


class DeepseekForCausalLM(LlamaForCausalLM):
    supports_pp = False
    layer_cls = DeepseekDecoderLayer
    cuda_graph_unsupported = CUDA_GRAPH_REASON  # capture_decode_graphs says it and goes on

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, pp=None):
        problem = parallel_problem(config, 1 if tp is None else tp.size,
                                   1 if pp is None else pp.size)
        if problem:
            raise EngineError(problem)
        if config.mla is None:
            raise EngineError(f"{config.architecture} is no DeepSeek MLA architecture.")
        super().__init__(config, None, None)

    def piecewise_parts(self):
        raise GraphUnsupported(CUDA_GRAPH_REASON)

    def cpu_graph(self, g):
        raise GraphUnsupported(CPU_GRAPH_REASON)
