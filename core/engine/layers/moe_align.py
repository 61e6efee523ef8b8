"""The (token, expert) pairs of a mixture-of-experts layer laid out for the fused GPU kernel
(layers/moe_triton.py), in torch ops and without a host sync (the sizes on the host are upper
bounds, the layout itself stays on the device).

``ids`` [T, k] are each token's experts; pair ``p`` is token ``p // k``'s ``p % k``-th choice.
The pairs are sorted by expert (stable: token order within an expert), each expert's run
padded up to a multiple of ``block`` with the sentinel ``P = T * k`` (no pair), so that every
block of ``block`` consecutive entries belongs to one expert, whose id ``block_experts`` gives
(-1 for a block past the last expert's run, and for an expert this rank does not hold when
``local`` maps the global ids to the rank's own: the kernel writes zeros for those pairs).
Experts without pairs take no block. The buffers are sized for the worst case,
``P + E * (block - 1)`` entries, so a launch's grid depends on T, k and E only."""

from __future__ import annotations

from typing import NamedTuple

import torch


class BlockLayout(NamedTuple):
    sorted_pairs: torch.Tensor  # [max entries] int32: pair ids by expert, padding = num_pairs
    block_experts: torch.Tensor  # [max entries / block] int32: each block's (local) expert, -1
    num_padded: torch.Tensor  # [1] int32: the entries in use (a multiple of block)
    num_pairs: int  # T * k, the sentinel


def max_entries(num_pairs: int, num_experts: int, block: int) -> int:
    """The worst-case padded length: every expert's run one pair past a block boundary."""
    worst = num_pairs + num_experts * (block - 1)
    return -(-worst // block) * block


def moe_align_block_size(ids: torch.Tensor, num_experts: int, block: int,
                         local: torch.Tensor | None = None) -> BlockLayout:
    """The pairs of ``ids`` [T, k] sorted by expert and padded per expert to ``block``;
    ``local`` [E] int: the rank's index of each global expert, -1 for one it does not hold."""
    flat = ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block - 1) // block * block
    ends = torch.cumsum(padded, 0)
    run_starts = ends - padded  # where each expert's padded run begins
    order = torch.sort(flat, stable=True).indices  # pair ids grouped by expert
    experts = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in ``order``
    rank = torch.arange(num_pairs, device=device) - first[experts]
    entries = max_entries(num_pairs, num_experts, block)
    sorted_pairs = torch.full((entries,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[run_starts[experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, entries, block, device=device)
    which = torch.searchsorted(ends, block_starts, right=True)  # E past the last run
    table = torch.arange(num_experts, device=device) if local is None else local.to(device)
    table = torch.cat([table.to(torch.int64), table.new_full((1,), -1, dtype=torch.int64)])
    block_experts = table[which].to(torch.int32)
    return BlockLayout(sorted_pairs, block_experts, ends[-1:].to(torch.int32), num_pairs)
