"""The logprobs of a prompt's own tokens (``echo`` + ``logprobs``), computed by the scheduler's
own batches: no other path calls the runner, so the overlap worker is never raced.

A request that asks for them (``Req.prompt_logprobs``: how many top entries per position)
runs its prompt from the first token, without a cached prefix, in chunks of at most
``PROMPT_LOGPROBS_TOKENS`` prompt tokens per step; a step holding such a chunk asks the runner
for the logits of every token (full-vocabulary rows: 512 x 128k x 4 bytes = 256 MiB, hence the
cap) and ``record`` keeps the chunk's logprobs before the step samples from the rows at each
request's last token. A request with ``max_new_tokens`` 0 is only scored: it finishes once its
prompt ran, sampling nothing (SGLang's and vLLM's echo-only scoring).
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.scheduler.request import Req

PROMPT_LOGPROBS_TOKENS = 512  # prompt tokens per step when a step scores a prompt


def all_logits_needed(chunks: list[tuple[Req, int]]) -> bool:
    """Does this step hold a prompt chunk whose logprobs are asked for?"""
    return any(r.prompt_logprobs is not None and r.scores_prompt for r, _ in chunks)


def chunk_cap(r: Req, step_tokens: int) -> int | None:
    """How many prompt tokens ``r`` may run in a step already holding ``step_tokens``, when it
    scores its prompt (None: no cap); 0 means wait for a step of its own."""
    if not r.scores_prompt:
        return None
    return max(PROMPT_LOGPROBS_TOKENS - step_tokens, 0)


def record(logits: torch.Tensor, batch: ForwardBatch, reqs: list[Req]) -> torch.Tensor:
    """From the logits of every token of ``batch`` (requests ``reqs`` in batch order), append the
    scoring requests' prompt logprobs; return the logits at each request's last new token."""
    offset = 0
    for b, r in enumerate(reqs):
        extend, start = batch.extend_lens_list[b], batch.prefix_lens_list[b]
        if r.prompt_logprobs is not None and r.scores_prompt:
            _record_chunk(r, logits[offset: offset + extend], start)
        offset += extend
    return logits[batch.logits_indices]


def _record_chunk(r: Req, logits: torch.Tensor, start: int) -> None:
    """``logits[k]`` is the distribution after prompt position ``start + k``: it scores prompt
    token ``start + k + 1``. Positions already recorded (a request retracted and recomputed)
    are skipped."""
    prompt = r.prompt_ids
    if not r.input_logprobs:
        r.input_logprobs.append(None)
        r.input_top_logprobs.append(None)
    first = len(r.input_logprobs)  # the next prompt position to score
    end = min(start + logits.shape[0], len(prompt) - 1)  # last scored position + 1 - 1
    if first > end:
        return
    assert first >= start + 1, "prompt logprobs recorded out of order"
    rows = logits[first - 1 - start: end - start]
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    targets = torch.tensor(prompt[first: end + 1], device=logprobs.device).unsqueeze(1)
    r.input_logprobs += logprobs.gather(1, targets).squeeze(1).tolist()
    top_n = r.prompt_logprobs
    if top_n > 0:
        values, idx = logprobs.topk(top_n, dim=-1)
        r.input_top_logprobs += [list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]
    else:
        r.input_top_logprobs += [[] for _ in range(end + 1 - first)]
