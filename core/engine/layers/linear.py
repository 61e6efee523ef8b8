"""Linear layers; MergedLinear packs several checkpoint projections (q/k/v, gate/up) into one
matmul, which is what makes small-batch CPU decode fast.

On CPU in float32 the loader prepacks every weight for oneDNN (``prepack_linears``): the weight
becomes an opaque blocked mkldnn tensor and the forward is ``torch.ops.mkldnn._linear_pointwise``,
1.5x faster than ``F.linear`` for a whole SmolLM2 step at 16 and 64 rows (1.2-1.3x at 1 and
256) on a 2-core AVX2 EPYC (benchmarks/linear_kernels.py). Elsewhere (CUDA, other dtypes) the
forward stays ``F.linear``.

These are the layers a quantization method may swap (see interfaces.QuantMethod): they say so
with ``quantizable = True`` and expose ``in_features``, ``out_features``, ``bias`` and, when
packed, ``shards`` (projection name -> output rows, in order)."""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn


# the batch size oneDNN picks its weight blocking for; 1 to 256 rows all run near their best
PREPACK_BATCH_HINT = 64
LINEAR_KERNEL_ENV = "ENGINE_LINEAR_KERNEL"  # "plain": keep F.linear (for comparisons)


def prepack_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when oneDNN prepacked linears run here, else why not."""
    if os.environ.get(LINEAR_KERNEL_ENV, "auto") == "plain":
        return f"{LINEAR_KERNEL_ENV}=plain"
    if device.type != "cpu":
        return f"{device.type} runs F.linear"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if dtype != torch.float32:
        return f"oneDNN prepacking is used for float32 only, not {dtype}"
    return None


class PrepackedWeight:
    """Mixin: a module whose ``weight`` [out, in] can be reordered once for oneDNN.

    With ``keep_plain`` (a head tied to the embedding, which still reads the plain weight) the
    packed copy is kept beside it; otherwise it replaces it (same bytes, no second copy)."""

    packed = False
    tied = False  # the weight is shared (a head tied to the embedding): keep it beside the copy
    packed_id = -1  # index in PACKED, how the compiled graph's custom op finds the weight

    def prepack(self, keep_plain: bool = False) -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                         PREPACK_BATCH_HINT)
        self.packed_id = len(PACKED)
        PACKED.append(weakref.ref(self))
        if keep_plain:
            self.register_buffer("packed_weight", packed, persistent=False)
        else:
            del self.weight
            self.register_buffer("weight", packed)
            self.packed_weight = self.weight
        self.packed = True

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed:
            if torch.compiler.is_compiling():
                return prepacked_linear(x, self.packed_id, bias, self.packed_weight.shape[0])
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


# every prepacked module of the process (weakly), by packed_id: an opaque oneDNN tensor cannot
# enter a traced graph, so the compiled graph calls prepacked_linear with the index instead
PACKED: list[weakref.ref] = []


@torch.library.custom_op("engine::prepacked_linear", mutates_args=())
def prepacked_linear(x: torch.Tensor, packed_id: int, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    weight = PACKED[packed_id]().packed_weight
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@prepacked_linear.register_fake
def _(x, packed_id, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def prepack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """Prepack every plain linear weight of ``model`` when oneDNN runs here; returns the log line
    that says which kernel the linear layers use."""
    reason = prepack_reason(torch.device(device), dtype)
    if reason is not None:
        return f"linear layers: F.linear ({reason})"
    n = 0
    for module in model.modules():
        if isinstance(module, PrepackedWeight) and not module.packed:
            module.prepack(keep_plain=module.tied)
            n += 1
    return (f"linear layers: {n} float32 weights prepacked for oneDNN "
            f"(torch.ops.mkldnn._linear_pointwise)")


class Linear(PrepackedWeight, nn.Module):
    quantizable = True
    shards: dict[str, int] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class MergedLinear(Linear):
    """Output rows are the named shards, in order: ``shards={"q_proj": 512, "k_proj": 128, ...}``.
    The loader copies checkpoint tensor ``...q_proj.weight`` into rows ``shard_rows("q_proj")``."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias)
        self.shards = dict(shards)
        self.shard_sizes = list(shards.values())
        self._offsets, start = {}, 0
        for name, size in shards.items():
            self._offsets[name] = (start, size)
            start += size

    @property
    def shard_names(self) -> list[str]:
        return list(self._offsets)

    def shard_rows(self, shard: str) -> tuple[int, int]:
        """(first row, number of rows) of ``shard`` in the weight and bias."""
        return self._offsets[shard]

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(x).split(self.shard_sizes, dim=-1)
