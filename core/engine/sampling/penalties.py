from __future__ import annotations

import torch

from engine.host import long_tensor

# Penalties touch only tokens a row has seen, so they work on flat positions row * V + token
# instead of dense [B, V] tensors: the cost follows the number of tokens, not the vocab size.
# HF's repetition rule divides a positive logit by the penalty and multiplies a negative one;
# OpenAI's frequency/presence rule subtracts count * f + (count > 0) * p.


class SeenTokens:
    """The tokens one request has seen, kept as running counts: the prompt's distinct ids are
    found once, and each output token updates a count as it is appended. A caller may keep one
    per request; SamplingBatch.build then reuses its distinct prompt ids."""

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


class PenaltyTable:
    """The penalised rows' seen tokens as running state, kept across steps on the logits'
    device: for each such row (table row k is batch row ``rows[k]``) the distinct tokens it has
    seen, ``tokens[k, :length[k]]`` (the prompt's, if it uses the repetition penalty, then each
    new output token in order of first use), with ``counts[k, j]`` the times tokens[k, j]
    occurs in the output (0 for a prompt-only token).

    After each step ``add`` folds the sampled tokens in with tensor ops only (a token already
    there bumps its count, a new one is appended): no Python pass over the tokens, no rebuild.
    ``apply`` penalises the logits at those positions; columns past a row's length repeat its
    column 0 (same position, same value), so one padded gather/scatter serves every row.
    Rows come and go through ``take`` (by index) and ``concat``.
    """

    __slots__ = ("vocab_size", "rows", "tokens", "counts", "length", "width", "repetition",
                 "frequency", "presence", "_steps")

    EXACT_WIDTH_EVERY = 64  # steps between reading the true max length back (a bound until then)

    def __init__(self, vocab_size, rows, tokens, counts, length, width, repetition, frequency,
                 presence, steps: int = 0):
        self.vocab_size = vocab_size
        self.rows = rows  # [P] int64: the batch row of each table row
        self.tokens = tokens  # [P, C] int64
        self.counts = counts  # [P, C] float32
        self.length = length  # [P] int64
        self.width = width  # python int >= max(length): the columns in use
        self.repetition, self.frequency, self.presence = repetition, frequency, presence  # [P]
        self._steps = steps  # add()s since width was last exact (carried through take, concat)

    @property
    def size(self) -> int:
        return self.rows.shape[0]

    @classmethod
    def build(cls, vocab_size: int, rows: list[int], prompts: list, outputs: list[list[int]],
              repetition: list[float], frequency: list[float], presence: list[float],
              device="cpu") -> PenaltyTable:
        """Table rows for batch ``rows``; ``prompts[k]``: the row's prompt ids (a list, or a
        SeenTokens whose distinct prompt ids are reused), counted only where repetition != 1."""
        ids, counts = [], []
        for prompt, out, rep in zip(prompts, outputs, repetition):
            if rep == 1.0:
                prompt_ids = torch.empty(0, dtype=torch.long)
            elif isinstance(prompt, SeenTokens):
                prompt_ids = prompt.prompt
            else:
                prompt_ids = torch.tensor(prompt, dtype=torch.long)
            out_ids = torch.tensor(out, dtype=torch.long)
            distinct, inverse = torch.unique(torch.cat([prompt_ids, out_ids]), return_inverse=True)
            count = torch.zeros(distinct.numel()).index_add_(
                0, inverse[prompt_ids.numel():], torch.ones(out_ids.numel()))
            ids.append(distinct)
            counts.append(count)
        lengths = [t.numel() for t in ids]
        width = max(lengths, default=0)
        capacity = _capacity(width)
        tokens = torch.zeros(len(ids), capacity, dtype=torch.long)
        count_table = torch.zeros(len(ids), capacity)
        for k, (t, c) in enumerate(zip(ids, counts)):
            tokens[k, : t.numel()] = t
            count_table[k, : c.numel()] = c
        assert not ids or 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size, \
            "id outside vocab"

        def to(x, dtype=None):
            return torch.as_tensor(x, dtype=dtype).to(device)

        return cls(vocab_size, to(rows, torch.long), to(tokens), to(count_table),
                   to(lengths, torch.long), width, to(repetition, torch.float32),
                   to(frequency, torch.float32), to(presence, torch.float32))

    def take(self, index: list[int], rows: list[int]) -> PenaltyTable:
        """Table rows ``index`` (of this table), now at batch rows ``rows``."""
        device = self.rows.device
        idx = long_tensor(index, device)

        def pick(x):
            return x.index_select(0, idx)

        return PenaltyTable(self.vocab_size, long_tensor(rows, device), pick(self.tokens),
                            pick(self.counts), pick(self.length), self.width,
                            pick(self.repetition), pick(self.frequency), pick(self.presence),
                            self._steps)

    @staticmethod
    def concat(a: PenaltyTable | None, b: PenaltyTable | None, offset: int) -> PenaltyTable | None:
        """``a``'s rows then ``b``'s, whose batch rows move down by ``offset``."""
        if a is None or b is None:
            if b is not None and offset:
                b = PenaltyTable(b.vocab_size, b.rows + offset, b.tokens, b.counts, b.length,
                                 b.width, b.repetition, b.frequency, b.presence, b._steps)
            return a if b is None else b
        capacity = max(a.tokens.shape[1], b.tokens.shape[1])

        def widen(x):
            return torch.nn.functional.pad(x, (0, capacity - x.shape[1]))

        return PenaltyTable(a.vocab_size, torch.cat([a.rows, b.rows + offset]),
                            torch.cat([widen(a.tokens), widen(b.tokens)]),
                            torch.cat([widen(a.counts), widen(b.counts)]),
                            torch.cat([a.length, b.length]), max(a.width, b.width),
                            torch.cat([a.repetition, b.repetition]),
                            torch.cat([a.frequency, b.frequency]),
                            torch.cat([a.presence, b.presence]), max(a._steps, b._steps))

    def _columns(self):
        """(tokens, counts) [P, width], columns past a row's length repeating its column 0."""
        width = self.width
        col = torch.arange(width, device=self.rows.device)
        src = torch.where(col < self.length.unsqueeze(1), col, 0)
        return self.tokens[:, :width].gather(1, src), self.counts[:, :width].gather(1, src)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """HF's repetition rule on every seen token, then OpenAI's frequency/presence formula on
        the output tokens (logits - count * f - (count > 0) * p). In place; logits [B, V]
        contiguous. A penalty a row does not use is its identity (x / 1, x - 0)."""
        if self.width == 0:
            return logits
        tokens, counts = self._columns()
        flat = logits.view(-1)
        pos = self.rows.unsqueeze(1) * logits.shape[1] + tokens
        values = flat[pos]
        rep = self.repetition.unsqueeze(1)
        penalized = torch.where(values < 0, values * rep, values / rep)
        # a row without any seen token has only padding (token 0, unseen): left alone
        penalized = torch.where(self.length.unsqueeze(1) > 0, penalized, values)
        penalized = (penalized - counts * self.frequency.unsqueeze(1)
                     - (counts > 0) * self.presence.unsqueeze(1))
        flat[pos] = penalized
        return logits

    def add(self, sampled: torch.Tensor) -> None:
        """Fold in the step's sampled tokens (``sampled`` [B], by batch row): one more output
        occurrence per table row, appended when new to the row."""
        token = sampled.index_select(0, self.rows).to(torch.long)
        n = self.size
        if self.width:
            col = torch.arange(self.width, device=token.device)
            match = (self.tokens[:, : self.width] == token.unsqueeze(1)) & (
                col < self.length.unsqueeze(1))
            found = match.any(dim=1)
            column = torch.where(found, match.to(torch.uint8).argmax(dim=1), self.length)
        else:
            found = torch.zeros(n, dtype=torch.bool, device=token.device)
            column = self.length
        if self.width + 1 > self.tokens.shape[1]:
            grow = _capacity(self.width + 1) - self.tokens.shape[1]
            self.tokens = torch.nn.functional.pad(self.tokens, (0, grow))
            self.counts = torch.nn.functional.pad(self.counts, (0, grow))
        every = torch.arange(n, device=token.device)
        self.tokens[every, column] = token
        self.counts[every, column] += 1
        self.length = self.length + (~found).to(torch.long)
        self.width += 1  # a bound: a row grows by at most one column per step
        self._steps += 1
        if self._steps >= self.EXACT_WIDTH_EVERY:
            # rows that repeat tokens grow slower than the bound: shrink it to the truth (a
            # read back, where the caller is about to read the sampled tokens anyway)
            self.width, self._steps = int(self.length.max()), 0


def _capacity(width: int) -> int:
    """Columns to allocate for ``width`` used ones (room to grow for a while)."""
    capacity = 64
    while capacity < width + 16:
        capacity *= 2
    return capacity
