from __future__ import annotations

from itertools import chain

import torch

# Penalties touch only tokens a row has seen, so they work on flat positions row * V + token
# instead of dense [B, V] tensors: the cost follows the number of tokens, not the vocab size.


def flat_token_index(
    id_lists: list[list[int]], vocab_size: int, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique flat positions (row * vocab_size + token) of each row's ids, and how often each occurs."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
    flat = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.long)
    assert flat.numel() == 0 or (flat.min() >= 0 and flat.max() < vocab_size), "id outside vocab"
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    index, counts = torch.unique(rows * vocab_size + flat, return_counts=True)
    return index.to(device), counts.to(device=device, dtype=torch.float32)


def apply_repetition_penalty(
    logits: torch.Tensor, index: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """HF's rule on seen tokens: positive logits / penalty, negative * penalty. In place.

    logits [B, V] contiguous; index from flat_token_index over prompt + output ids; penalty [B].
    """
    flat = logits.view(-1)
    values = flat[index]
    p = penalty[index // logits.shape[1]]
    flat[index] = torch.where(values < 0, values * p, values / p)
    return logits


def apply_frequency_presence_penalty(
    logits: torch.Tensor,
    index: torch.Tensor,
    counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """OpenAI's rule: logits - count * frequency - (count > 0) * presence. In place.

    logits [B, V] contiguous; index and counts from flat_token_index over output ids only;
    frequency and presence [B].
    """
    flat = logits.view(-1)
    rows = index // logits.shape[1]
    flat[index] = flat[index] - counts * frequency[rows] - presence[rows]
    return logits
