from __future__ import annotations

from itertools import chain

import torch

# Penalties touch only tokens a row has seen, so they work on flat positions row * V + token
# instead of dense [B, V] tensors: the cost follows the number of tokens, not the vocab size.


class SeenTokens:
    """The tokens one request has seen, kept as running counts: the prompt's distinct ids are
    found once, and each output token updates a count as it is appended. A step's penalty
    index then costs O(distinct output tokens) for the request, never a re-scan of the prompt."""

    __slots__ = ("prompt", "_prompt_set", "counts", "new")

    def __init__(self, vocab_size: int, prompt_ids: list[int], output_ids: list[int] = ()):
        self.prompt = torch.unique(torch.tensor(prompt_ids, dtype=torch.long))  # distinct, sorted
        ends = self.prompt[[0, -1]].tolist() if prompt_ids else []
        assert all(0 <= t < vocab_size for t in (*ends, *output_ids)), "id outside vocab"
        self._prompt_set = set(prompt_ids)
        self.counts: dict[int, int] = {}  # output token -> times it occurs in the output
        self.new: list[int] = []  # output tokens absent from the prompt, in order of first use
        for token in output_ids:
            self.add(token)

    def add(self, token: int) -> None:
        """Count one more output token."""
        count = self.counts.get(token)
        if count is None:
            self.counts[token] = 1
            if token not in self._prompt_set:
                self.new.append(token)
        else:
            self.counts[token] = count + 1


def _flat(rows: list[tuple[int, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Concatenate per-row id tensors into flat positions row * vocab_size + id."""
    lengths = torch.tensor([ids.numel() for _, ids in rows], dtype=torch.long)
    offsets = torch.tensor([row * vocab_size for row, _ in rows], dtype=torch.long)
    return torch.cat([ids for _, ids in rows]) + torch.repeat_interleave(offsets, lengths)


def repetition_index(seen: list[SeenTokens | None], vocab_size: int, device="cpu") -> torch.Tensor:
    """Distinct flat positions of each row's prompt and output tokens (rows with None: none)."""
    rows = [(i, s.prompt) for i, s in enumerate(seen) if s is not None]
    new = [i * vocab_size + t for i, s in enumerate(seen) if s is not None for t in s.new]
    return torch.cat([_flat(rows, vocab_size), torch.tensor(new, dtype=torch.long)]).to(device)


def output_counts(seen: list[SeenTokens | None], vocab_size: int,
                  device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct flat positions of each row's output tokens, and how often each occurs."""
    index = [i * vocab_size + t for i, s in enumerate(seen) if s is not None for t in s.counts]
    counts = chain.from_iterable(s.counts.values() for s in seen if s is not None)
    return (torch.tensor(index, dtype=torch.long, device=device),
            torch.tensor(list(counts), dtype=torch.float32, device=device))


def apply_repetition_penalty(
    logits: torch.Tensor, index: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """HF's rule on seen tokens: positive logits / penalty, negative * penalty. In place.

    logits [B, V] contiguous; index from repetition_index (distinct positions); penalty [B].
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

    logits [B, V] contiguous; index and counts from output_counts; frequency and presence [B].
    """
    flat = logits.view(-1)
    rows = index // logits.shape[1]
    flat[index] = flat[index] - counts * frequency[rows] - presence[rows]
    return logits
