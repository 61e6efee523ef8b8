"""A step's batch: the ForwardBatch of its decodes and prompt chunks (decodes first), and once
it ran, which of its rows sample a token and which requests only scored their prompt."""

from __future__ import annotations

from engine.forward_batch import ForwardBatch
from engine.scheduler.kv import DecodeSlots
from engine.scheduler.request import Req


def forward_batch(table, decodes: list[Req], chunks: list[tuple[Req, int]],
                  decode_ids: list[list[int]] | None = None,
                  grown: DecodeSlots | None = None) -> ForwardBatch:
    """The batch of the decodes (their last token, or ``decode_ids``) and prompt chunks over the
    request table ``table``; ``grown``: what ``grow_decodes(decodes)`` returned (their rows,
    positions and slots)."""
    if not chunks and grown is not None and decode_ids is None:  # the usual decode step
        ids = [(r.output_ids or r.prompt_ids)[-1] for r in decodes]
        return ForwardBatch.decode(ids, grown.positions, grown.rows, table,
                                   device=table.device, out_cache_loc=grown.slots)
    if not chunks:  # a decode step: one token each, the last of its sequence
        lens, rows = [], []  # one pass over the requests
        if decode_ids is None:
            ids = []
            for r in decodes:
                ids.append((r.output_ids or r.prompt_ids)[-1])
                lens.append(r.kv_len)
                rows.append(r.row)
        else:
            ids = [x[0] for x in decode_ids]
            for r in decodes:
                lens.append(r.kv_len)
                rows.append(r.row)
        return ForwardBatch.decode(ids, lens, rows, table, device=table.device)
    reqs = decodes + [r for r, _ in chunks]
    if decode_ids is None:
        decode_ids = [r.tokens(r.kv_len, r.kv_len + 1) for r in decodes]
    return ForwardBatch.build(decode_ids + [r.tokens(r.kv_len, r.kv_len + n)
                                            for r, n in chunks],
                              [r.kv_len for r in reqs], [r.row for r in reqs], None, table,
                              device=table.device)


def rows_to_sample(reqs: list[Req], num_decodes: int) -> list[int]:
    """Indices of the rows to sample among a batch's ``reqs`` (its ``num_decodes`` decodes
    first), once it ran: every decode, and the prompts whose K/V now covers the whole
    sequence; never a request only scoring its prompt (max_new_tokens 0)."""
    return [i for i, r in enumerate(reqs) if r.params.max_new_tokens > 0
            and (i < num_decodes or r.kv_len == r.seq_len)]


def scored_done(reqs: list[Req]) -> list[Req]:
    """The requests among a batch's ``reqs`` that only score their prompt (max_new_tokens
    0) and whose whole prompt the batch completes."""
    return [r for r in reqs if r.params.max_new_tokens == 0 and r.kv_len == r.seq_len]
