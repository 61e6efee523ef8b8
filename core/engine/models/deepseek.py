"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (layers/mla.py: the KV pool holds
the compressed latent and the rope key, one row per token and layer) and a mixture of experts
with shared experts and DeepSeek's routing (layers/moe_routing.py, through layers/moe.py's
``SparseMoE``) where ``first_k_dense_replace`` and ``moe_layer_freq`` say, llama.py's dense MLP
elsewhere. The embedding, rotary tables (the rope dimensions, with yarn), final norm and head
are llama.py's. Checkpoint names are HF's: ``self_attn.{q_proj | q_a_proj, q_a_layernorm,
q_b_proj}``, ``self_attn.kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``;
``mlp.gate.weight`` (+ ``e_score_correction_bias`` with noaux_tc), ``mlp.experts.{i}.*`` and
``mlp.shared_experts.*``.

With ``--tp-size`` the attention heads are cut over the ranks, the latent replicated
(engine.parallel.mla), the routed experts placed as models/moe.py's are (``--ep-size``), the
shared experts and the dense MLPs cut like a dense MLP; one all-reduce per attention and per
feed-forward block.

With ``--pp-size`` a stage holds its layers (llama.py's stages), each dense or sparse by its
index in the model.

Decode steps run in CUDA graphs where every sparse layer takes the fused Triton kernel and the
attention backend can be captured (triton's MLA; flashinfer's MLA wrappers cannot yet: the
start line says so). Not yet, each refused with its reason: piecewise CUDA graphs of prompts;
the CPU graph; attention backends without MLA (``register_attention_backends(mla=True)``:
torch_native, and triton on a CUDA GPU)."""

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
from engine.models.llama import MLP
from engine.models.moe import ExpertsForCausalLM
from engine.parallel.experts import expert_problem
from engine.parallel.group import TPGroup
from engine.parallel.mla import ParallelMLAttention
from engine.parallel.moe import rank_experts, shared_expert

CUDA_GRAPH_REASON = ("DeepSeek's MoE layers on the per-expert loop read their per-expert token "
                     "counts on the host, which a captured graph cannot (the fused Triton kernel, "
                     "on CUDA with triton, runs inside graphs)")
PIECEWISE_REASON = "DeepSeek models' prompts are not captured in piecewise CUDA graphs yet"
CPU_GRAPH_REASON = "MLA attention and MoE layers have no CPU graph nodes yet"


class DeepseekMoE(SparseMoE):
    """The routed experts (DeepSeek's routing, float32 weights as transformers') plus the
    shared experts every token runs, summed."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None):
        c, r = config, config.routing
        experts = None if tp is None else rank_experts(
            c.hidden_size, c.moe_intermediate_size, c.num_experts,
            ("gate_proj", "up_proj", "down_proj"), tp)[0]
        super().__init__(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                         c.num_experts_per_tok, c.norm_topk_prob, float32_weights=True,
                         gate=GroupedTopKRouter(c.hidden_size, c.num_experts, r),
                         experts=experts, tp=tp)
        if r.n_shared_experts:
            shared = c.moe_intermediate_size * r.n_shared_experts
            self.shared_experts = (Expert(c.hidden_size, shared) if tp is None else
                                   shared_expert(c.hidden_size, shared, tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x).to(x.dtype)
        if hasattr(self, "shared_experts"):  # partial too over ranks: one all-reduce for both
            out = out + self.shared_experts(x)
        return self.reduce(out)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup | None = None,
                 global_id: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = (MLAttention(config, layer_id) if tp is None else
                          ParallelMLAttention(config, layer_id, tp))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # dense or sparse by the layer's index in the model (a pipeline stage's layer_id is
        # its index in the stage's KV pool)
        sparse = config.is_moe_layer(layer_id if global_id is None else global_id)
        self.mlp = DeepseekMoE(config, tp) if sparse else MLP(config, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


def parallel_problem(config: ModelConfig, tp_size: int, ep_size: int = 1) -> str | None:
    """Why ``config`` cannot be split over ``tp_size`` tensor-parallel ranks with ``--ep-size``
    ``ep_size`` (None: it can; pipeline stages split it by layers)."""
    if tp_size == 1:
        return None
    c, what = config, []
    if c.num_heads % tp_size:
        what.append(f"its {c.num_heads} attention heads")
    if any(not c.is_moe_layer(i) for i in range(c.num_layers)) and \
            c.intermediate_size % tp_size:
        what.append(f"its dense layers' intermediate size {c.intermediate_size}")
    shared = c.moe_intermediate_size * (c.routing.n_shared_experts if c.routing else 0)
    if c.num_experts and shared % tp_size:
        what.append(f"its shared experts' intermediate size {shared}")
    if what:
        return (f"{c.architecture}: {' and '.join(what)} do not split over --tp-size "
                f"{tp_size}; use a --tp-size that divides them.")
    problem = c.num_experts and expert_problem(c.num_experts, c.moe_intermediate_size,
                                               tp_size, ep_size)
    return f"{c.architecture}: {problem}" if problem else None


class DeepseekForCausalLM(ExpertsForCausalLM):
    layer_cls = DeepseekDecoderLayer
    unfused_graph_reason = CUDA_GRAPH_REASON  # (ExpertsForCausalLM.cuda_graph_unsupported)
    cpu_graph_reason = CPU_GRAPH_REASON

    def piecewise_parts(self):
        raise GraphUnsupported(PIECEWISE_REASON)
    parallel_problem = staticmethod(parallel_problem)

    def sparse_block(self, config: ModelConfig, tp: TPGroup) -> tuple[str, nn.Module]:
        return "mlp", DeepseekMoE(config, tp)

    def check_config(self, config: ModelConfig) -> None:
        if config.mla is None:
            raise EngineError(f"{config.architecture} is no DeepSeek MLA architecture.")
