"""The token bitmask of a step (xgrammar's and llguidance's layout: int32 words, bit j of word i
allows token 32 * i + j), and its application to the logits as one vectorized masked fill."""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask for ``rows`` rows, every token disallowed until a matcher fills its row."""
    return torch.zeros(rows, bitmask_words(vocab_size), dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, device) -> torch.Tensor:
    """bool [R, vocab_size] on ``device``: True where the token is allowed."""
    device = torch.device(device)
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device, non_blocking=True)
    # (w >> j) & 1 is bit j also for the sign bit: the arithmetic shift keeps the low bit right
    bits = (words.unsqueeze(-1) >> shifts).bitwise_and_(1).bool()
    return bits.view(words.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set to -inf, in place, the logits of the tokens ``bitmask`` does not allow. ``rows``: the
    logits rows that bitmask's rows belong to (None: all of them, in order)."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1], logits.device)
    if rows is None:
        assert allowed.shape[0] == logits.shape[0]
        return logits.masked_fill_(~allowed, float("-inf"))
    rows = rows.to(logits.device)
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, masked)
