"""SamplingState: a scheduler's sampling inputs kept across steps, rebuilt only for the rows
that join (SGLang's SamplingBatchInfo)."""

from __future__ import annotations

from operator import attrgetter

import torch

from engine.sampling.batch import SamplingBatch

_OUTPUT_IDS = attrgetter("output_ids")


class SamplingState:
    """The sampling inputs of the rows a scheduler sampled last step, kept across steps (as
    SGLang's SamplingBatchInfo is): when the step samples the same requests as the last one,
    nothing is rebuilt; when some leave or join, the kept rows are taken by index and the new
    rows' tensors concatenated. A row is kept while its request is sampled every step (its
    output one token longer each time, as ``advance`` assumes); otherwise it is rebuilt.

    Use from one thread at a time: ``batch(reqs, device)``, sample, ``advance(tokens)``.
    """

    def __init__(self, vocab_size: int, eos_token_ids):
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.current: SamplingBatch | None = None
        self.reqs: list = []
        self.rows_built = 0  # rows built from requests' params so far (for tests, benchmarks)

    def batch(self, reqs: list, device) -> SamplingBatch:
        """The SamplingBatch of ``reqs`` (objects with params, prompt_ids, output_ids) in that
        order, its tensors on ``device``; ``allowed`` is reset to None."""
        lengths = list(map(len, map(_OUTPUT_IDS, reqs)))
        cur, device = self.current, torch.device(device)
        if cur is not None and cur.device != device:
            cur = None
        if cur is not None and reqs == self.reqs and lengths == cur.lengths:
            cur.allowed = None
            return cur  # the same requests, one token further: nothing to rebuild
        index = {r: i for i, r in enumerate(self.reqs)} if cur is not None else {}
        kept, new, slots = [], [], []  # slots: per req, its row in kept (>= 0) or ~its new rank
        for r, length in zip(reqs, lengths):
            i = index.get(r)
            if i is not None and cur.lengths[i] == length:
                slots.append(len(kept))
                kept.append(i)
            else:
                slots.append(~len(new))
                new.append(r)
        merged = None
        if kept:
            merged = cur if kept == list(range(cur.size)) else cur.take(kept, derive=False)
        if new or merged is None:
            built = SamplingBatch.build([r.params for r in new], [r.prompt_ids for r in new],
                                        [r.output_ids for r in new], None, self.eos_token_ids,
                                        self.vocab_size, device=device, derive=False)
            merged = built if merged is None else SamplingBatch.concat(merged, built, False)
        order = [s if s >= 0 else len(kept) + ~s for s in slots]
        if order != list(range(len(order))):
            merged = merged.take(order, derive=False)
        merged.derive()
        merged.allowed = None
        self.current, self.reqs = merged, list(reqs)
        self.rows_built += len(new)
        return merged

    def advance(self, sampled: torch.Tensor) -> None:
        """``sampled`` [B]: the tokens just sampled from the batch ``batch`` returned."""
        self.current.advance(sampled)

    def skip(self, reqs: list, counts: list[int]) -> None:
        """The requests of the last ``batch`` (``reqs``, in its order) took ``counts`` tokens
        each without sampling through this state (a greedy verify step's argmax): move their
        rows on as many positions. A state it cannot move (other requests, penalties counting
        the tokens, a ban in force) is dropped, and the next ``batch`` rebuilds its rows."""
        cur = self.current
        if cur is None or reqs != self.reqs or not cur.skip(counts):
            self.current, self.reqs = None, []
