from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.grammar.bitmask import apply_token_bitmask
from engine.sampling.params import SamplingParams
from engine.sampling.penalties import (
    SeenTokens,
    apply_frequency_presence_penalty,
    apply_repetition_penalty,
    output_counts,
    repetition_index,
)


def make_generator(seed: int | None, device="cpu") -> torch.Generator | None:
    """A request's own RNG, made once on arrival and kept for all its steps; None without a seed."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % 2**64)
    return gen


@dataclass(slots=True)
class SampleOutput:
    """What the sampler picked for each row of a step."""

    next_token_ids: torch.Tensor  # [B] int64
    # log_softmax of the raw model logits (before penalties and temperature) at the chosen token.
    logprobs: torch.Tensor | None
    # Per row, the most likely (token, logprob) pairs under that raw distribution; [] if not asked.
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass(slots=True)
class SamplingBatch:
    """Per-step sampling inputs for B rows, built once per step by the scheduler.

    Tensors are per row ([B]) unless noted; penalties use flat positions row * V + token. A
    feature no row uses is None, so the sampler skips it.
    """

    vocab_size: int
    temperature: torch.Tensor  # float32; 1.0 on greedy rows so that dividing is harmless
    greedy: torch.Tensor  # bool
    all_greedy: bool
    any_greedy: bool
    filter_rows: torch.Tensor | None  # rows that use top-k, top-p or min-p
    top_k: torch.Tensor | None  # int64 in [1, V]; V where off
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    repetition_index: torch.Tensor | None  # positions seen in prompt or output
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    output_index: torch.Tensor | None  # positions seen in the output
    output_counts: torch.Tensor | None  # float32, one count per output_index entry
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf
    seeded: list[tuple[int, torch.Generator]]  # sampled rows that draw from their own generator
    top_logprobs: list[int] | None  # per row: -1 = no logprobs, else how many top entries
    # structured output: (rows [R] int64, bitmask [R, ceil(V/32)] int32 on the host) of the
    # constrained rows; set by the scheduler after build() (engine.grammar.bitmask's layout)
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: set[int] | list[int],
        vocab_size: int,
        device="cpu",
        seen: list[SeenTokens | None] | None = None,
    ) -> SamplingBatch:
        """Gather the rows' parameters into tensors; generators[i] is make_generator(seed).

        ``seen[i]``: row i's running token counts (kept by the caller across steps), needed
        where params[i].uses_penalties; without ``seen`` they are counted here from the ids.
        """
        n = len(params)
        assert len(prompt_ids) == n and len(output_ids) == n and len(generators) == n
        if seen is None:
            seen = [SeenTokens(vocab_size, pr, out) if p.uses_penalties else None
                    for p, pr, out in zip(params, prompt_ids, output_ids)]
        for p, gen in zip(params, generators):
            assert p.seed is None or gen is not None, "a seeded request needs its own generator"
        V = vocab_size

        def tensor(values, used=True, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device) if used else None

        # Below this temperature logits / T overflows float32, and the pick is the argmax anyway.
        greedy = [p.is_greedy or p.temperature < 1e-5 for p in params]
        top_k = [p.top_k if 1 <= p.top_k < V and not g else V for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        filtered = [i for i in range(n) if top_k[i] < V or top_p[i] < 1.0 or min_p[i] > 0.0]

        rep = [p.repetition_penalty for p in params]
        rep_index = None
        if any(r != 1.0 for r in rep):
            rep_index = repetition_index([s if r != 1.0 else None for s, r in zip(seen, rep)],
                                         V, device)
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        out_index = counts = None
        if any(f != 0.0 or q != 0.0 for f, q in zip(freq, pres)):
            out_index, counts = output_counts(
                [s if f != 0.0 or q != 0.0 else None for s, f, q in zip(seen, freq, pres)],
                V, device)

        banned_rows, banned_ids = [], []
        for i, (p, out) in enumerate(zip(params, output_ids)):
            if len(out) < p.min_new_tokens:
                ban = sorted({t for t in (*eos_token_ids, *p.stop_token_ids) if t < V})
                banned_rows += [i] * len(ban)
                banned_ids += ban
        banned = (tensor(banned_rows, dtype=torch.long), tensor(banned_ids, dtype=torch.long))

        asked = any(p.logprobs for p in params)
        return cls(
            vocab_size=V,
            temperature=tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            greedy=tensor(greedy, dtype=torch.bool),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            filter_rows=tensor(filtered, bool(filtered), dtype=torch.long),
            top_k=tensor(top_k, any(k < V for k in top_k), dtype=torch.long),
            top_p=tensor(top_p, any(p < 1.0 for p in top_p)),
            min_p=tensor(min_p, any(m > 0.0 for m in min_p)),
            repetition_penalty=tensor(rep, rep_index is not None),
            repetition_index=rep_index,
            frequency_penalty=tensor(freq, counts is not None),
            presence_penalty=tensor(pres, counts is not None),
            output_index=out_index,
            output_counts=counts,
            banned=banned if banned_rows else None,
            seeded=[(i, g) for i, g in enumerate(generators) if g is not None and not greedy[i]],
            top_logprobs=[p.top_logprobs if p.logprobs else -1 for p in params] if asked else None,
        )


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


class Sampler:
    """Picks one token per row of a step's logits, vectorized over the batch.

    Order: penalties on the raw logits, the min_new_tokens ban, the grammar mask (so a
    constrained greedy row takes its best allowed token), then argmax for greedy rows, and
    temperature, top-k, top-p, min-p and an exponential race for the others.
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
                tokens = penalized.argmax(dim=-1)
            else:
                probs = self.warp(penalized, batch).softmax(dim=-1)
                tokens = (probs / self._noise(probs, batch)).argmax(dim=-1)
                if batch.any_greedy:
                    tokens = torch.where(batch.greedy, penalized.argmax(dim=-1), tokens)
            return self._with_logprobs(raw, tokens, batch)

    def penalize(self, logits: torch.Tensor, batch: SamplingBatch,
                 inplace: bool = False) -> torch.Tensor:
        """Repetition, frequency and presence penalties, the min_new_tokens ban, then the
        grammar mask (in a copy unless ``inplace``)."""
        if (batch.repetition_index is None and batch.output_index is None and batch.banned is None
                and batch.allowed is None):
            return logits
        if not inplace or not logits.is_contiguous():
            logits = logits.clone(memory_format=torch.contiguous_format)
        if batch.repetition_index is not None:
            apply_repetition_penalty(logits, batch.repetition_index, batch.repetition_penalty)
        if batch.output_index is not None:
            apply_frequency_presence_penalty(
                logits,
                batch.output_index,
                batch.output_counts,
                batch.frequency_penalty,
                batch.presence_penalty,
            )
        if batch.banned is not None:
            logits[batch.banned] = float("-inf")
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

    def _noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # argmax(p / E) with E ~ Exp(1) picks token i with probability p_i. A seeded row's noise
        # comes only from its own generator, so its pick ignores the other rows and their order.
        uniform = torch.empty_like(probs)
        if len(batch.seeded) < batch.size:
            uniform.uniform_()
        for row, gen in batch.seeded:
            uniform[row] = torch.empty_like(probs[row]).uniform_(generator=gen)
        # -log(U) is Exp(1) and, with U in [0, 1), never 0 (so p / E is never 0 / 0 = NaN);
        # on CPU it is several times faster than exponential_.
        return uniform.log_().neg_()

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
