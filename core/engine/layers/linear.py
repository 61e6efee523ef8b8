"""Linear layers; MergedLinear packs several checkpoint projections (q/k/v, gate/up) into one
matmul, which is what makes small-batch CPU decode fast.

These are the layers a quantization method may swap (see interfaces.QuantMethod): they say so
with ``quantizable = True`` and expose ``in_features``, ``out_features``, ``bias`` and, when
packed, ``shards`` (projection name -> output rows, in order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    quantizable = True
    shards: dict[str, int] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
