"""Sharded layers of a tensor-parallel model (Megatron layout, as in vLLM and SGLang).

Column-parallel: each rank holds some output rows (q/k/v heads, gate/up rows) and computes its
part of the output, no communication. Row-parallel: each rank holds the input columns matching
the column-parallel part before it and all-reduces its partial sum (o, down). Vocab-parallel:
each rank holds a chunk of vocab rows; the embedding zeroes ids outside its chunk and
all-reduces, the LM head all-gathers its logits. Every layer says how the loader cuts a
checkpoint tensor for it (``tp_cut(local, shard)``, None: the full tensor)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.embedding import Embedding, LMHead
from engine.layers.linear import Linear, MergedLinear
from engine.parallel.group import TPGroup
from engine.parallel.shard import Cut, split_evenly


class ColumnParallelLinear(MergedLinear):
    """A packed projection cut by output rows: ``shards`` maps each checkpoint projection to
    (its full rows, the rank's cut of them); the rank holds its rows of each, in order."""

    def __init__(self, in_features: int, shards: dict[str, tuple[int, Cut]], bias: bool,
                 tp: TPGroup):
        super().__init__(in_features, {n: c.size(full) for n, (full, c) in shards.items()}, bias)
        self.tp, self.cuts = tp, {n: c for n, (_, c) in shards.items()}

    def tp_cut(self, local: str, shard: str | None) -> Cut:
        return self.cuts[shard]


class PartialRowLinear(Linear):
    """Input columns cut (``cut``: dim 1, chunk ``cut.index`` of ``cut.parts``), no bias, the
    output left partial: the caller sums it over the ranks (an MoE block's experts, summed
    with one all-reduce for the whole block)."""

    def __init__(self, in_features: int, out_features: int, cut: Cut, what: str):
        super().__init__(split_evenly(in_features, cut.parts, what), out_features)
        self.cut = cut

    def tp_cut(self, local: str, shard: str | None) -> Cut | None:
        return self.cut if local == "weight" else None


class RowParallelLinear(Linear):
    """Input columns cut over the ranks; the partial outputs are all-reduced, then the (full,
    replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, what: str):
        super().__init__(split_evenly(in_features, tp.size, what), out_features, bias)
        self.tp, self.cut = tp, Cut(1, tp.size, tp.rank)

    def tp_cut(self, local: str, shard: str | None) -> Cut | None:
        return self.cut if local == "weight" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(Embedding):
    """Vocab rows cut over the ranks (the last chunk zero-padded when they do not divide)."""

    def __init__(self, num_embeddings: int, dim: int, tp: TPGroup):
        self.cut = Cut(0, tp.size, tp.rank)
        super().__init__(self.cut.size(num_embeddings), dim)
        self.tp, self.start = tp, self.cut.bounds(num_embeddings)[0]

    def init_buffers(self) -> None:
        self.weight.zero_()  # padding rows past the vocabulary stay zero

    def tp_cut(self, local: str, shard: str | None) -> Cut:
        return self.cut

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(LMHead):
    """Vocab rows cut like the embedding's (so a tied head shares its shard); each rank's
    logits are all-gathered into the full [.., vocab] logits."""

    def __init__(self, dim: int, vocab_size: int, tp: TPGroup):
        self.cut = Cut(0, tp.size, tp.rank)
        super().__init__(dim, self.cut.size(vocab_size))
        self.tp, self.vocab_size = tp, vocab_size

    def init_buffers(self) -> None:
        if not self.tied:
            self.weight.zero_()

    def tp_cut(self, local: str, shard: str | None) -> Cut:
        return self.cut

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(self.linear(hidden), dim=-1)[..., :self.vocab_size]
