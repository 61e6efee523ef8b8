"""Log-probabilities of a prompt's own tokens (``echo`` + ``logprobs`` on /v1/completions).

The scheduler only keeps logits at each request's last token, so this is a one-off prefill of
the whole prompt on scratch KV slots, run on the engine thread between two steps. It never
touches the radix cache (its slots are private and freed before returning), so the scheduler's
slot accounting holds again as soon as it returns.
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch

RETRY = object()  # the pool is busy: run again after the next step
# Prompt positions per forward: full-vocabulary logits for every position are large
# (512 x 128k vocab x 4 bytes = 256 MiB), so long prompts go through in chunks.
CHUNK = 512


def prompt_logprobs(engine, ids: list[int], top_n: int):
    """``(logprobs, top)``: logprobs[i] is log p(ids[i] | ids[:i]) (None for i = 0) and top[i]
    the ``top_n`` most likely ``(token_id, logprob)`` there (None for i = 0); or RETRY."""
    if len(ids) < 2:
        return [None] * len(ids), [None] * len(ids)
    kv, runner = engine.scheduler.kv, engine.runner
    pool = kv.pool
    need = pool.pages_needed(0, len(ids)) * pool.page_size
    if not kv.ensure_free(need):
        return RETRY
    row = pool.alloc_req()
    if row is None:
        return RETRY
    slots = None
    chosen: list[float] = []
    top: list = [None]
    try:
        slots = pool.extend_slots(row, 0, len(ids))
        assert slots is not None, "ensure_free() promised the slots"
        for start in range(0, len(ids) - 1, CHUNK):
            end = min(start + CHUNK, len(ids) - 1)  # the last token predicts nothing
            batch = ForwardBatch.build([ids[start:end]], [start], [row], slots[start:end],
                                       pool.req_to_token, device=pool.req_to_token.device)
            logits = runner.forward(batch, return_all_logits=True)  # [end - start, V]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            nxt = torch.tensor(ids[start + 1:end + 1], device=logprobs.device).unsqueeze(1)
            chosen += logprobs.gather(1, nxt).squeeze(1).tolist()
            if top_n > 0:
                values, idx = logprobs.topk(top_n, dim=-1)
                top += [list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]
            else:
                top += [[] for _ in range(end - start)]
        return [None, *chosen], top
    finally:
        if slots is not None:
            pool.free_slots_of(slots)
        pool.free_req(row)
