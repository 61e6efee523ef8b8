"""A mixture-of-experts feed-forward block (Qwen3-MoE's and Mixtral's sparse layers).

A router (``Router``: logits over the experts) picks each token's top-k experts; the (token,
expert) pairs are sorted by expert, so each active expert's tokens are contiguous rows, and
each active expert runs its SwiGLU MLP on its rows alone: one GEMM for gate and up packed
together (a ``MergedLinear``, as a dense MLP's), one for down. The outputs are weighted by the
routing weights and added into their tokens' rows (``index_add_``), which sums each token's k
experts without a [T * k, hidden] buffer put back in token order.

The experts' projections are the engine's ``Linear``/``MergedLinear``, so everything that
applies to a dense layer's linears applies to theirs: oneDNN prepacking, fbgemm's float16
weights, a plugin's linear kernel (``prepack_linears``), and a quantization method's swap
(``swap_quantizable``: each expert's projections become the method's quantized layers). The
router stays float: a plain weight through ``F.linear`` (E rows, negligible work), exactly as
transformers computes the logits, so that near-tied top-k choices fall the same way.

Numerics follow transformers (its default ``grouped_mm`` experts path): softmax in float32,
top-k of the probabilities, optional renormalization in float32, the weights cast to the
model's dtype (Qwen3-MoE) or left in float32 (Mixtral, ``float32_weights``), each expert's
output times its weight, summed over the k experts (in float32, in expert order rather than
top-k order: float32 rounding apart, the same sum), cast to the model's dtype.

The router is a module with ``select(x, top_k, renormalize, weight_dtype) -> (weights, ids)``:
``Router`` (the logits' softmax top-k above), or another routing handed to ``SparseMoE`` as
``gate`` (DeepSeek's grouped top-k with sigmoid or softmax scores: layers/moe_routing.py).

Over a tensor-parallel group (``tp``: engine.parallel.moe builds the experts) a rank holds a
slice of every expert, or whole experts of its own (``--ep-size``), the others standing as
``AbsentExpert``; its sum is partial and one all-reduce over the group completes the block
(``tp.all_reduce``, after the cast to the model's dtype, as a dense row-parallel layer's).

On a CPU, where a plugin's linear kernel with a grouped GEMM runs the experts' weight dtype
(layers/moe_grouped.py; engine-cpu-kernels' for float32, float16 and bfloat16 weights), the
experts run in two calls into it (gate_up for every expert's rows, SiLU-and-multiply, down)
instead of the loop below (``grouped``): the same arithmetic per expert, the threads spread
over all experts' weight tiles rather than over one expert's few rows at a time.

The expert loop reads the per-expert counts on the host: fine on a CPU; on a GPU it syncs
once per layer and cannot be captured in a CUDA graph (the MoE models refuse those), and
``torch.compile`` leaves the block out of its graph (``torch.compiler.disable``). On CUDA the
loop gives way to the fused Triton kernel (``fused``: layers/moe_fused.py stacks the held
experts' weights at load, layers/moe_triton.py runs them) after the same routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import Linear, MergedLinear


class Router(nn.Module):
    """The gate: ``weight`` [experts, hidden] -> router logits [T, experts]."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def select(self, x: torch.Tensor, top_k: int, renormalize: bool,
               weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of the tokens ``x`` [T, hidden]."""
        return route(self(x), top_k, renormalize, weight_dtype)


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in ``weight_dtype``, expert ids [T, k]) of router ``logits`` [T, E]:
    the top-k softmax probabilities (float32), renormalized to sum to 1 if asked."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weight_dtype), ids


def weighted(y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expert outputs ``y`` [n, hidden] times their routing weights ``w`` [n, 1], in ``dtype``
    (in place where the dtypes already agree)."""
    return y.mul_(w) if y.dtype == w.dtype == dtype else (y * w).to(dtype)


class Expert(nn.Module):
    """One expert's SwiGLU MLP, its projections named as the checkpoint names them (Qwen3-MoE:
    gate_proj, up_proj, down_proj; Mixtral: w1, w3, w2): gate and up are one packed
    projection (``gate_up_proj``, whose shards load the checkpoint's two tensors)."""

    def __init__(self, hidden_size: int, intermediate_size: int, gate: str = "gate_proj",
                 up: str = "up_proj", down: str = "down_proj"):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {gate: intermediate_size,
                                                       up: intermediate_size})
        self.down_name = down
        setattr(self, down, Linear(intermediate_size, hidden_size))

    @property
    def down(self) -> nn.Module:
        """The down projection, whatever its name."""
        return self._modules[self.down_name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down(F.silu(gate).mul_(up))


class AbsentExpert(nn.Module):
    """An expert another expert-parallel rank holds: no weights here, its tokens skipped."""


class SparseMoE(nn.Module):
    """``gate`` (the router) and ``experts`` (a list of ``Expert``), as the checkpoints name
    them; ``forward`` x [T, hidden] -> [T, hidden]."""

    # the fused GPU kernel over the stacked experts (layers/moe_fused.py), None: the loop
    fused = None
    # the CPU grouped GEMMs over the packed experts (layers/moe_grouped.py), None: the loop
    grouped = None

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, names: tuple[str, str, str] = ("gate_proj", "up_proj",
                                                                     "down_proj"),
                 float32_weights: bool = False, gate: nn.Module | None = None,
                 experts: nn.ModuleList | None = None, tp=None):
        """``gate``: the router (a module with ``select``, see above); default ``Router``.
        ``experts`` and ``tp``: a rank's experts (engine.parallel.moe) and its tensor-parallel
        group, whose all-reduce completes the block; default every expert whole, no group."""
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.float32_weights = renormalize, float32_weights
        self.gate = Router(hidden_size, num_experts) if gate is None else gate
        self.experts = experts if experts is not None else nn.ModuleList(
            Expert(hidden_size, intermediate_size, *names) for _ in range(num_experts))
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.routed(x).to(x.dtype))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """``y``, this rank's partial output, summed over the tensor-parallel group."""
        return y if self.tp is None else self.tp.all_reduce(y)

    @torch.compiler.disable
    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, hidden] (float32 for half models) over the
        experts (or slices) this rank holds."""
        k = self.top_k
        weights, ids = self.gate.select(x, k, self.renormalize,
                                        torch.float32 if self.float32_weights else x.dtype)
        if self.fused is not None:
            return self.fused(x, weights, ids)
        flat = ids.reshape(-1)  # [T * k] (token, expert) pairs, token-major
        order = torch.sort(flat, stable=True).indices  # grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        tokens = order // k  # each pair's token, in expert order
        pair_weights = weights.reshape(-1)[order].unsqueeze(-1)
        rows = x.index_select(0, tokens)
        # each expert's weighted rows are added straight into their tokens' sums (float32
        # for half models: one rounding at the end, as a sum over the k experts would)
        out = x.new_zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32))
        if self.grouped is not None:  # every expert's rows in two calls (absent ones: zero)
            return out.index_add_(0, tokens, weighted(self.grouped(rows, counts), pair_weights,
                                                      out.dtype))
        start = 0
        for expert, n in zip(self.experts, counts.tolist()):
            end = start + n
            if n and not isinstance(expert, AbsentExpert):
                y = weighted(expert(rows[start:end]), pair_weights[start:end], out.dtype)
                out.index_add_(0, tokens[start:end], y)
            start = end
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"renormalize={self.renormalize}, float32_weights={self.float32_weights}")
