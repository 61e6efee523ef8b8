"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import PrepackedWeight


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(PrepackedWeight, nn.Module):
    def __init__(self, dim: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)

    def tie_to(self, embedding: Embedding) -> None:
        self.weight = embedding.weight
        self.tied = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden)
