"""The Sampler: one token per row of a step's logits (penalties, bans and the grammar mask,
then greedy or temperature, top-k, top-p, min-p and a draw), and the logprobs asked for."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.grammar.bitmask import apply_token_bitmask
from engine.sampling.batch import MIN_NEW_TOKENS, POSITION, SamplingBatch
from engine.sampling.seeds import sample_inverse_cdf


@dataclass(slots=True)
class SampleOutput:
    """What the sampler picked for each row of a step."""

    next_token_ids: torch.Tensor  # [B] int64
    # log_softmax of the raw model logits (before penalties and temperature) at the chosen token.
    logprobs: torch.Tensor | None
    # Per row, the most likely (token, logprob) pairs under that raw distribution; [] if not asked.
    top_logprobs: list[list[tuple[int, float]]] | None


def top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Mask to -inf what top-k, then top-p, then min-p drop (HF's rules, per row), with one sort.

    logits [B, V]; top_k [B] int64 in [1, V] (V = off); top_p [B] in (0, 1]; min_p [B] in [0, 1].
    """
    # Ascending order, as HF's top-p does, so the cumulative sums match it bit for bit.
    values, order = logits.sort(dim=-1)
    V = logits.shape[-1]
    if top_k is not None:
        kth_largest = values.gather(1, (V - top_k).unsqueeze(1))
        values = values.masked_fill(values < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = values.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        values = values.masked_fill(drop, float("-inf"))
    if min_p is not None:
        probs = values.softmax(dim=-1)
        # The largest probability sits in the last column.
        drop = probs < (min_p * probs[:, -1]).unsqueeze(1)
        values = values.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, values)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row's first largest entry, as ``logits.argmax(dim=-1)``. On a CPU numpy's
    vectorised argmax takes a tenth of torch's time (a 49152-token vocabulary: 3 against 29 us
    a row on a Zen 5) and picks the same index (the first maximum; a NaN counts as one)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(axis=1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


class Sampler:
    """Picks one token per row of a step's logits, vectorized over the batch.

    Order: penalties on the raw logits, the min_new_tokens ban, the grammar mask (so a
    constrained greedy row takes its best allowed token), then argmax for greedy rows, and
    temperature, top-k, top-p, min-p and a draw for the others: an exponential race with the
    global RNG, or for a seeded row the inverse CDF at its seed's hash (seeds.py).
    """

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch,
                 overwrite: bool = False) -> SampleOutput:
        """``overwrite``: the caller no longer needs ``logits``, so the penalties may change
        them in place instead of in a copy (a [B, V] copy is the largest cost of a step's
        sampling at large B); they are kept when a row asks for logprobs of the raw logits."""
        assert logits.dim() == 2 and logits.shape == (batch.size, batch.vocab_size)
        with torch.inference_mode():  # the runner's logits are inference tensors
            raw = logits.float()
            penalized = self.penalize(raw, batch,
                                      inplace=overwrite and batch.top_logprobs is None)
            if batch.all_greedy:
                tokens = argmax_rows(penalized)
            else:
                probs = self.warp(penalized, batch).softmax(dim=-1)
                tokens = self._draw(probs, batch)
                if batch.any_greedy:
                    tokens = torch.where(batch.greedy, argmax_rows(penalized), tokens)
            return self._with_logprobs(raw, tokens, batch)

    def penalize(self, logits: torch.Tensor, batch: SamplingBatch,
                 inplace: bool = False) -> torch.Tensor:
        """Repetition, frequency and presence penalties, the min_new_tokens ban, then the
        grammar mask (in a copy unless ``inplace``)."""
        if batch.penalties is None and batch.banned is None and batch.allowed is None:
            return logits
        if not inplace or not logits.is_contiguous():
            logits = logits.clone(memory_format=torch.contiguous_format)
        if batch.penalties is not None:
            batch.penalties.apply(logits)
        if batch.banned is not None:
            rows, ids = batch.banned
            active = batch.ints[rows, POSITION] < batch.ints[rows, MIN_NEW_TOKENS]
            logits[rows, ids] = torch.where(active, float("-inf"), logits[rows, ids])
        if batch.allowed is not None:
            rows, bitmask = batch.allowed
            apply_token_bitmask(logits, bitmask, None if rows.numel() == batch.size else rows)
        return logits

    def warp(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, then top-k, top-p and min-p; the result is what sampled rows draw from."""
        logits = logits / batch.temperature.unsqueeze(1)
        rows = batch.filter_rows
        if rows is None:
            return logits
        # Sorting costs the most, so only the rows that filter are sorted.
        whole = rows.numel() == batch.size
        per_row = [
            t if whole or t is None else t[rows] for t in (batch.top_k, batch.top_p, batch.min_p)
        ]
        if whole:
            return top_k_top_p_min_p(logits, *per_row)
        logits[rows] = top_k_top_p_min_p(logits[rows], *per_row)
        return logits

    def _draw(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per row from ``probs``: unseeded rows race exponential noise from the
        global RNG; seeded rows invert their CDF at their seed's hash of their position (one
        call for all of them), so a seeded pick ignores the other rows and their order."""
        rows = batch.seed_rows
        everyone = rows is not None and rows.numel() == batch.size
        tokens = None if everyone else argmax_rows(probs / self._noise(probs))
        if rows is not None:
            uniform = batch.seed_uniform()
            if everyone:
                tokens = sample_inverse_cdf(probs, uniform)
            else:
                tokens[rows] = sample_inverse_cdf(probs[rows], uniform)
        return tokens

    def _noise(self, probs: torch.Tensor) -> torch.Tensor:
        # argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.
        # -log(U) is Exp(1) and, with U in [0, 1), never 0 (so p / E is never 0 / 0 = NaN);
        # on CPU it is several times faster than exponential_.
        return torch.empty_like(probs).uniform_().log_().neg_()

    def _with_logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
    ) -> SampleOutput:
        if batch.top_logprobs is None:
            return SampleOutput(tokens, None, None)
        logprobs = raw.log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k = max(batch.top_logprobs)
        top: list[list[tuple[int, float]]] = [[] for _ in batch.top_logprobs]
        if k > 0:
            values, ids = logprobs.topk(k, dim=-1)
            values, ids = values.tolist(), ids.tolist()
            for row, want in enumerate(batch.top_logprobs):
                if want > 0:
                    top[row] = list(zip(ids[row][:want], values[row][:want]))
        return SampleOutput(tokens, chosen, top)
