"""What rank 0 sends the workers for one forward, and how a batch is cut into micro-batches.

The workers hold a copy of the request table (``req_to_token``) that only rank 0's scheduler
writes; a message carries the table writes since the last forward (the pool's ``row_edits``
journal) and the batch's host lists, from which every rank builds the same ForwardBatch on its
own device. The workers never sample: rank 0 samples from the full logits and the next batch
carries the tokens it chose, so every rank computes on the same tokens by construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from engine.forward_batch import ForwardBatch


@dataclass
class BatchMessage:
    edits: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (rows, positions, slots)
    input_ids: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    rows: list[int]
    return_all_logits: bool
    parts: int = 1  # micro-batches (pipeline stages)
    # ENGINE_PARALLEL_CHECK=1 (the tests): a checksum of the batch's rows of rank 0's table,
    # which a worker compares with its copy's
    check: int | None = None
    # HiCache: the copies rank 0 made between its pool and its host tier since the last batch,
    # for each rank to make in its own (hicache/copier.py: replay_copies)
    copies: list = field(default_factory=list)

    @classmethod
    def of(cls, batch: ForwardBatch, edits: list, return_all_logits: bool) -> "BatchMessage":
        message = cls(edits, batch.input_ids.tolist(), list(batch.prefix_lens_list),
                      list(batch.extend_lens_list), batch.req_pool_indices.tolist(),
                      return_all_logits)
        if os.environ.get("ENGINE_PARALLEL_CHECK"):
            message.check = message.checksum(batch.req_to_token)
        return message

    def apply_edits(self, table: torch.Tensor) -> None:
        for rows, positions, slots in self.edits:
            table[rows.to(table.device), positions.to(table.device)] = slots.to(table.device)
        if self.check is not None and self.checksum(table) != self.check:
            raise RuntimeError("this rank's copy of the request table differs from rank 0's "
                               "after the batch's edits: a table write bypassed "
                               "KVPool.write_row / write_slots")

    def checksum(self, table: torch.Tensor) -> int:
        total = 0
        for row, p, e in zip(self.rows, self.prefix_lens, self.extend_lens):
            slots = table[row, : p + e].long().cpu()
            total += int((slots * torch.arange(1, p + e + 1)).sum())
        return total

    def batches(self, table: torch.Tensor) -> list[ForwardBatch]:
        """The batch as ``parts`` micro-batches of whole requests (fewer when it has fewer
        requests), contiguous and about equal in tokens."""
        parts = self.parts
        ids, start = [], 0
        for n in self.extend_lens:
            ids.append(self.input_ids[start: start + n])
            start += n
        return [ForwardBatch.build(ids[a:b], self.prefix_lens[a:b], self.rows[a:b], None, table,
                                   device=table.device)
                for a, b in split_evenly_by_tokens(self.extend_lens, parts)]


def split_evenly_by_tokens(extend_lens: list[int], parts: int) -> list[tuple[int, int]]:
    """[a, b) request ranges, at most ``parts``, none empty, in order, each closing once it
    holds its share of the tokens left."""
    n = len(extend_lens)
    parts = max(1, min(parts, n))
    ranges, a, left = [], 0, sum(extend_lens)
    for k in range(parts, 0, -1):
        if k == 1:
            ranges.append((a, n))
            break
        share, b, got = left / k, a, 0
        while b < n - (k - 1) and (got == 0 or got + extend_lens[b] / 2 <= share):
            got += extend_lens[b]
            b += 1
        ranges.append((a, b))
        a, left = b, left - got
    return ranges
