"""Mixture-of-experts models of the Llama family: Qwen3-MoE (Qwen3's attention with q/k norms;
sparse layers where ``decoder_sparse_step`` and ``mlp_only_layers`` say, the dense MLP
elsewhere; ``norm_topk_prob`` either way) and Mixtral (Mistral's attention and sliding window,
every layer sparse, top-2 renormalized). Everything but the sparse feed-forward block is
llama.py's; the block is layers/moe.py's ``SparseMoE``, named as the checkpoints name it
(``mlp.gate``, ``mlp.experts.{i}.gate_proj/up_proj/down_proj``; Mixtral's
``block_sparse_moe.gate``, ``block_sparse_moe.experts.{i}.w1/w3/w2``), so the loader maps the
per-expert tensors one to one as it does a dense layer's.

With ``--tp-size`` the attention is llama.py's tensor-parallel attention and each sparse block
holds this rank's experts (engine.parallel.moe: every expert's intermediate slice, or with
``--ep-size`` whole experts of its own), the router whole, one all-reduce per block; the
checkpoint tensors of experts another rank holds are never read (``other_rank_tensor``).

With ``--pp-size`` a stage holds its layers (llama.py's stages; each layer sparse or dense by
its index in the model).

Decode steps and (with --enable-piecewise-cuda-graph) prompts run in CUDA graphs where every
sparse layer takes the fused Triton kernel (CUDA with triton: no host sync, every launch size
an upper bound); the per-expert loop reads its counts on the host, so a model on it is not
captured (the start line says why). Not yet, refused with its reason: the CPU graph (no MoE
node yet)."""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from engine.errors import EngineError
from engine.interfaces import GraphUnsupported
from engine.layers.moe import SparseMoE
from engine.models.config import ModelConfig
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.parallel import experts as placement
from engine.parallel.dp_attention import in_step
from engine.parallel.group import TPGroup
from engine.parallel.moe import rank_experts


class MoELayout(NamedTuple):
    """How an architecture's checkpoint names its sparse block, and how HF weights it."""

    block: str  # the block's name in a decoder layer
    names: tuple[str, str, str]  # an expert's gate, up and down projections
    float32_weights: bool  # the routing weights multiply in float32 (else the model's dtype)


LAYOUTS = {
    "Qwen3MoeForCausalLM": MoELayout("mlp", ("gate_proj", "up_proj", "down_proj"), False),
    "MixtralForCausalLM": MoELayout("block_sparse_moe", ("w1", "w3", "w2"), True),
}

CUDA_GRAPH_REASON = ("MoE layers on the per-expert loop read their per-expert token counts on "
                     "the host, which a captured graph cannot (the fused Triton kernel, on CUDA "
                     "with triton, runs inside graphs)")



def parallel_problem(config: ModelConfig, tp_size: int, ep_size: int = 1) -> str | None:
    """Why ``config`` cannot be split over ``tp_size`` tensor-parallel ranks with ``--ep-size``
    ``ep_size`` as far as its experts go (None: it can; a dense model with ``ep_size`` 1).
    Pipeline stages split any of them by layers."""
    if not config.num_experts:
        if ep_size > 1:
            return (f"--ep-size {ep_size} splits a mixture-of-experts model's experts, and "
                    f"{config.architecture} has none; drop --ep-size (or "
                    f"--enable-expert-parallel).")
        return None
    problem = placement.expert_problem(config.num_experts, config.moe_intermediate_size,
                                       tp_size, ep_size)
    return f"{config.architecture}: {problem}" if problem else None


def held_elsewhere(place: placement.ExpertPlacement | None, name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a routed expert's that another rank holds."""
    expert = placement.checkpoint_expert(name)
    return place is not None and expert is not None and not place.holds(expert)


def sparse_block(config: ModelConfig, tp: TPGroup | None) -> tuple[str, nn.Module]:
    """(its name in a decoder layer, a sparse block holding ``tp``'s rank's experts)."""
    layout, c = LAYOUTS[config.architecture], config
    experts = None if tp is None else rank_experts(
        c.hidden_size, c.moe_intermediate_size, c.num_experts, layout.names, tp)[0]
    return layout.block, SparseMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                                   c.num_experts_per_tok, c.norm_topk_prob, layout.names,
                                   layout.float32_weights, experts=experts, tp=tp)


def dp_attention_problem(config: ModelConfig, ranks: int, ep_size: int) -> str | None:
    """Why ``config``'s MoE layers cannot be split over ``ranks`` data-parallel attention
    ranks (the attention and dense layers stay whole; DeepSeek's shared experts are cut)."""
    if not config.num_experts:
        return (f"--enable-dp-attention is for mixture-of-experts models (their MoE layers run "
                f"over every rank); {config.architecture} has none: serve it with --dp-size "
                f"{ranks} replicas instead.")
    shared = config.moe_intermediate_size * (config.routing.n_shared_experts
                                             if config.routing else 0)
    if shared % ranks:
        return (f"{config.architecture}: its shared experts' intermediate size {shared} does "
                f"not split over {ranks} ranks; use a --tp-size that divides it.")
    problem = placement.expert_problem(config.num_experts, config.moe_intermediate_size,
                                       ranks, ep_size)
    return f"{config.architecture}: {problem}" if problem else None


class MoEDecoderLayer(DecoderLayer):
    def feed_forward(self, config: ModelConfig, tp: TPGroup | None,
                     global_id: int) -> tuple[str, nn.Module]:
        if not config.is_moe_layer(global_id):
            return super().feed_forward(config, tp, global_id)
        return sparse_block(config, tp)


class ExpertsForCausalLM(LlamaForCausalLM):
    """What the mixture-of-experts families share: the parallel layouts they cannot split
    refused up front (``parallel_problem``, the module's), the rank's expert placement, other
    ranks' experts left unread by the loader, no graphs (each says why)."""

    supports_pp = True  # a stage's layers, named by their global index (llama.py)
    unfused_graph_reason = CUDA_GRAPH_REASON
    cpu_graph_reason = "MoE layers have no CPU graph nodes yet"
    parallel_problem = staticmethod(parallel_problem)

    def check_config(self, config: ModelConfig) -> None:
        """Refuse a config this family cannot build (before anything is built)."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, pp=None):
        # data-parallel attention (engine.parallel.dp_attention): everything whole but the
        # sparse blocks, which hold this rank's experts and run over every rank's tokens
        dp = tp if getattr(tp, "dp_attention", False) else None
        if dp is not None:
            problem = dp_attention_problem(config, dp.size, dp.ep_size)
            if pp is not None:
                problem = "--enable-dp-attention with pipeline stages is not supported."
            tp = None
        else:
            problem = self.parallel_problem(config, 1 if tp is None else tp.size,
                                            1 if tp is None else getattr(tp, "ep_size", 1))
        if problem:
            raise EngineError(problem)
        self.check_config(config)
        super().__init__(config, tp, pp)
        if dp is not None:
            for global_id, layer in enumerate(self.model.layers):
                if config.is_moe_layer(global_id):
                    name, block = self.sparse_block(config, dp)
                    setattr(layer, name, block)
                    in_step(block, dp)
        # where this rank's routed experts are (None: one process, every expert whole)
        split = tp or dp
        self.experts_placement = None if split is None or not config.num_experts else \
            placement.expert_placement(config.num_experts, config.moe_intermediate_size, split)

    def sparse_block(self, config: ModelConfig, tp: TPGroup) -> tuple[str, nn.Module]:
        """(its name in a decoder layer, a sparse block of ``tp``'s rank's experts)."""
        return sparse_block(config, tp)

    def other_rank_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is another rank's: the loader skips it unread."""
        return self.other_stage_tensor(name) or held_elsewhere(self.experts_placement, name)

    @property
    def cuda_graph_unsupported(self) -> str | None:
        """Why decode steps are not captured (capture_decode_graphs says it and goes on): None
        once every sparse layer is on the fused kernel (the runner fuses them at start)."""
        layers = [m for m in self.modules() if isinstance(m, SparseMoE)]
        return None if layers and all(m.fused is not None for m in layers) else \
            self.unfused_graph_reason

    def piecewise_parts(self):
        """Prompts in piecewise CUDA graphs: as the dense models', once every sparse layer runs
        the fused kernel (a padded token is routed like any other, its row discarded)."""
        why = self.cuda_graph_unsupported
        if why:
            raise GraphUnsupported(why)
        return super().piecewise_parts()

    def cpu_graph(self, g):
        raise GraphUnsupported(self.cpu_graph_reason)


class MoEForCausalLM(ExpertsForCausalLM):
    layer_cls = MoEDecoderLayer

    def check_config(self, config: ModelConfig) -> None:
        if config.architecture not in LAYOUTS:
            raise EngineError(f"{config.architecture} has no MoE layout here (known: "
                              f"{', '.join(LAYOUTS)}).")
