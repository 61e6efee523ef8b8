"""Mixture-of-experts models of the Llama family: Qwen3-MoE (Qwen3's attention with q/k norms;
sparse layers where ``decoder_sparse_step`` and ``mlp_only_layers`` say, the dense MLP
elsewhere; ``norm_topk_prob`` either way) and Mixtral (Mistral's attention and sliding window,
every layer sparse, top-2 renormalized). Everything but the sparse feed-forward block is
llama.py's; the block is layers/moe.py's ``SparseMoE``, named as the checkpoints name it
(``mlp.gate``, ``mlp.experts.{i}.gate_proj/up_proj/down_proj``; Mixtral's
``block_sparse_moe.gate``, ``block_sparse_moe.experts.{i}.w1/w3/w2``), so the loader maps the
per-expert tensors one to one as it does a dense layer's.

Not yet (issue 31's later parts), each refused with its reason: tensor parallelism and expert
parallelism (``--tp-size``, ``--ep-size``), pipeline stages (``--pp-size``), CUDA graphs and
piecewise CUDA graphs (the expert loop reads its per-expert counts on the host), the CPU graph
(no MoE node yet)."""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from engine.errors import EngineError
from engine.interfaces import GraphUnsupported
from engine.layers.moe import SparseMoE
from engine.models.config import ModelConfig
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.parallel.group import TPGroup


class MoELayout(NamedTuple):
    """How an architecture's checkpoint names its sparse block, and how HF weights it."""

    block: str  # the block's name in a decoder layer
    names: tuple[str, str, str]  # an expert's gate, up and down projections
    float32_weights: bool  # the routing weights multiply in float32 (else the model's dtype)


LAYOUTS = {
    "Qwen3MoeForCausalLM": MoELayout("mlp", ("gate_proj", "up_proj", "down_proj"), False),
    "MixtralForCausalLM": MoELayout("block_sparse_moe", ("w1", "w3", "w2"), True),
}

CUDA_GRAPH_REASON = ("MoE layers read their per-expert token counts on the host, which a "
                     "captured graph cannot (the fused GPU MoE kernel is issue 31's later part)")


def parallel_problem(config: ModelConfig, tp_size: int, pp_size: int) -> str | None:
    """Why an MoE ``config`` cannot be served over ``tp_size`` x ``pp_size`` ranks (None: it
    can, or it is no MoE model)."""
    if not config.num_experts or tp_size * pp_size == 1:
        return None
    return (f"{config.architecture} is a mixture-of-experts model ({config.num_experts} "
            f"experts), which the engine serves in one process for now: --tp-size does not "
            f"split its experts, expert parallelism (--ep-size, issue 31) is not available "
            f"yet, nor are --pp-size stages for it. Serve it with --tp-size 1 --pp-size 1.")


class MoEDecoderLayer(DecoderLayer):
    def feed_forward(self, config: ModelConfig, tp: TPGroup | None,
                     global_id: int) -> tuple[str, nn.Module]:
        if not config.is_moe_layer(global_id):
            return super().feed_forward(config, tp, global_id)
        layout = LAYOUTS[config.architecture]
        return layout.block, SparseMoE(config.hidden_size, config.moe_intermediate_size,
                                       config.num_experts, config.num_experts_per_tok,
                                       config.norm_topk_prob, layout.names,
                                       layout.float32_weights)


class MoEForCausalLM(LlamaForCausalLM):
    supports_pp = False
    layer_cls = MoEDecoderLayer
    cuda_graph_unsupported = CUDA_GRAPH_REASON  # capture_decode_graphs says it and goes on

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, pp=None):
        problem = parallel_problem(config, 1 if tp is None else tp.size,
                                   1 if pp is None else pp.size)
        if problem:
            raise EngineError(problem)
        if config.architecture not in LAYOUTS:
            raise EngineError(f"{config.architecture} has no MoE layout here (known: "
                              f"{', '.join(LAYOUTS)}).")
        super().__init__(config, tp, pp)

    def piecewise_parts(self):
        raise GraphUnsupported(CUDA_GRAPH_REASON)

    def cpu_graph(self, g):
        raise GraphUnsupported("MoE layers have no CPU graph nodes yet")
