"""DeepSeek's routing for ``SparseMoE`` (its ``gate``): softmax or sigmoid scores of float32
logits, top-k over all experts (``greedy``) or within the best ``topk_group`` of ``n_group``
expert groups (``group_limited_greedy``: a group scores its best expert; ``noaux_tc``: the sum
of its best two, of the scores plus the checkpoint's ``e_score_correction_bias``, which steers
the choice only), the chosen experts' scores (without the bias) as weights, renormalized if
asked, times ``routed_scaling_factor``. Numerics as transformers' DeepseekV2/V3 routers:
logits in float32 from the float32 hidden states, float32 weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import EngineError
from engine.layers.moe import Router


def grouped_topk(logits: torch.Tensor, top_k: int, scoring: str, method: str, n_group: int,
                 topk_group: int, renormalize: bool, scaling: float,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) of float32 router ``logits`` [T, E]."""
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if method != "greedy":
        T, E = choice.shape
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = (grouped.max(-1).values if method == "group_limited_greedy" else
                        grouped.topk(2, dim=-1)[0].sum(-1))
        groups = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        # transformers' fills: 0 under softmax's positive scores, -inf where a bias may be < 0
        choice = choice.masked_fill(~keep, 0.0 if method == "group_limited_greedy" else
                                    float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class GroupedTopKRouter(Router):
    """The gate of a DeepSeek MoE layer: ``weight`` [experts, hidden] and, with ``noaux_tc``,
    ``e_score_correction_bias`` [experts] (kept in float32 whatever the model's dtype)."""

    def __init__(self, hidden_size: int, num_experts: int, routing):
        """``routing``: the model's ``GroupedRouting`` (models/deepseek_config.py)."""
        super().__init__(hidden_size, num_experts)
        self.routing = routing
        self.correction_bias: torch.Tensor | None = None  # loaded with noaux_tc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())

    def select(self, x: torch.Tensor, top_k: int, renormalize: bool,
               weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        weights, ids = grouped_topk(self(x), top_k, r.scoring, r.topk_method, r.n_group,
                                    r.topk_group, renormalize, r.routed_scaling_factor,
                                    self.correction_bias)
        return weights.to(weight_dtype), ids

    def checkpoint_tensors(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        bias = ("e_score_correction_bias",) if self.routing.topk_method == "noaux_tc" else ()
        return ("weight", *bias), ()

    def load_tensor(self, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        want = self.weight.shape if name == "weight" else self.weight.shape[:1]
        if tuple(tensor.shape) != tuple(want):
            raise EngineError(f"the router's {name} has shape {tuple(tensor.shape)} in the "
                              f"checkpoint; the model expects {tuple(want)} (n_routed_experts "
                              f"x hidden_size).")
        if name == "weight":
            self.weight.copy_(tensor)
        else:  # float32, as transformers keeps it: a bfloat16 bias would round the choice
            self.correction_bias = tensor.to(self.weight.device, torch.float32)

    def extra_repr(self) -> str:
        r = self.routing
        return (f"scoring={r.scoring}, topk_method={r.topk_method}, n_group={r.n_group}, "
                f"topk_group={r.topk_group}, routed_scaling_factor={r.routed_scaling_factor}")
