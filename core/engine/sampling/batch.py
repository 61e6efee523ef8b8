"""SamplingBatch: the sampling inputs of a step's rows as tensors on the logits' device (per-row
parameters packed in two tensors, the index lists of the rows each sampler stage needs), built
from requests' parameters, filtered, concatenated and advanced one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.host import float_tensor, long_tensor
from engine.sampling.params import SamplingParams
from engine.sampling.penalties import PenaltyTable, SeenTokens
from engine.sampling.seeds import counter_uniform, seed_key

_PLUS_ONE = (1).__add__

# columns of SamplingBatch.floats [B, 6] float32 and SamplingBatch.ints [B, 4] int64
TEMPERATURE, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE = range(6)
TOP_K, SEED_KEY, POSITION, MIN_NEW_TOKENS = range(4)


@dataclass(frozen=True, slots=True)
class RowInfo:
    """The host's facts about one row, fixed for its request's life (what decides which of the
    sampler's stages a batch needs, and the index lists of the rows that need them)."""

    greedy: bool
    top_k: bool  # top-k is on
    top_p: bool
    min_p: bool
    seeded: bool  # sampled (not greedy) with a seed
    penalized: bool  # any of the three penalties
    min_new_tokens: int
    ban: tuple[int, ...]  # EOS and stop ids (in the vocab) banned until min_new_tokens
    top_logprobs: int  # -1: no logprobs, else how many top entries

    @property
    def filters(self) -> bool:
        return self.top_k or self.top_p or self.min_p


@dataclass(slots=True, eq=False)
class SamplingBatch:
    """The sampling inputs of B rows, as tensors on the logits' device.

    Per-row parameters sit in two packed tensors (``floats`` and ``ints``, columns named by the
    constants above) so that keeping, dropping or adding rows is one index or concat each;
    ``SamplingState`` keeps one across steps and only filters and merges it as requests come
    and go. A feature no row uses is None, so the sampler skips it. ``advance`` moves it to the
    next step with the tokens just sampled (positions, penalty counts, min_new_tokens bans).
    """

    vocab_size: int
    floats: torch.Tensor  # [B, 6] float32: temperature (1.0 if greedy), top_p, min_p, penalties
    ints: torch.Tensor  # [B, 4] int64: top_k (V = off), seed key, output position, min_new_tokens
    greedy: torch.Tensor  # [B] bool
    infos: list[RowInfo]
    lengths: list[int]  # per row, its output tokens before this step's one
    penalties: PenaltyTable | None  # the rows using a penalty, with the tokens they have seen
    # derived from infos (derive)
    all_greedy: bool = True
    any_greedy: bool = False
    filter_rows: torch.Tensor | None = None  # rows that use top-k, top-p or min-p
    top_k: torch.Tensor | None = None  # int64 in [1, V]; V where off
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seed_rows: torch.Tensor | None = None  # sampled rows that draw from their seed's hash
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids) while min_new_tokens
    ban_steps: int = 0  # steps until no row's ban matters any more
    top_logprobs: list[int] | None = None  # per row: -1 = no logprobs, else how many top entries
    # structured output: (rows [R] int64, bitmask [R, ceil(V/32)] int32 on the host) of the
    # constrained rows; set by the scheduler every step (engine.grammar.bitmask's layout)
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def size(self) -> int:
        return self.floats.shape[0]

    @property
    def device(self) -> torch.device:
        return self.floats.device

    @property
    def temperature(self) -> torch.Tensor:
        return self.floats[:, TEMPERATURE]

    @property
    def positions(self) -> torch.Tensor:
        """[B] int64: each row's output length, the counter its seed's hash draws with."""
        return self.ints[:, POSITION]

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators=None,
        eos_token_ids: set[int] | list[int] = (),
        vocab_size: int | None = None,
        device="cpu",
        seen: list[SeenTokens | None] | None = None,
        derive: bool = True,
    ) -> SamplingBatch:
        """Gather the rows' parameters into tensors on ``device``.

        ``generators`` is ignored (a seed needs no generator: seeds.py); ``seen[i]``, if given,
        lends row i's distinct prompt ids to the repetition penalty.
        """
        n = len(params)
        assert len(prompt_ids) == n and len(output_ids) == n
        assert vocab_size is not None
        V = vocab_size
        eos = sorted(set(eos_token_ids))
        infos, floats, ints = [], [], []
        for p, out in zip(params, output_ids):
            # Below this temperature logits / T overflows float32, and the pick is the argmax.
            greedy = p.is_greedy or p.temperature < 1e-5
            top_k = p.top_k if 1 <= p.top_k < V and not greedy else V
            top_p = 1.0 if greedy else p.top_p
            min_p = 0.0 if greedy else p.min_p
            seeded = p.seed is not None and not greedy
            ban = (tuple(sorted({t for t in (*eos, *p.stop_token_ids) if t < V}))
                   if p.min_new_tokens > 0 else ())
            infos.append(RowInfo(greedy, top_k < V, top_p < 1.0, min_p > 0.0, seeded,
                                 p.uses_penalties, p.min_new_tokens, ban,
                                 p.top_logprobs if p.logprobs else -1))
            floats.append((1.0 if greedy else p.temperature, top_p, min_p, p.repetition_penalty,
                           p.frequency_penalty, p.presence_penalty))
            ints.append((top_k, seed_key(p.seed) if seeded else 0, len(out), p.min_new_tokens))
        penalized = [k for k, info in enumerate(infos) if info.penalized]
        penalties = None
        if penalized:
            prompts = [seen[k] if seen is not None and seen[k] is not None else prompt_ids[k]
                       for k in penalized]
            penalties = PenaltyTable.build(V, penalized, prompts,
                                           [output_ids[k] for k in penalized],
                                           [floats[k][REPETITION] for k in penalized],
                                           [floats[k][FREQUENCY] for k in penalized],
                                           [floats[k][PRESENCE] for k in penalized], device)
        batch = cls(
            vocab_size=V,
            floats=float_tensor(floats, device).view(n, 6),
            ints=long_tensor(ints, device).view(n, 4),
            greedy=long_tensor([info.greedy for info in infos], device).view(n).bool(),
            infos=infos,
            lengths=[len(out) for out in output_ids],
            penalties=penalties,
        )
        if derive:
            batch.derive()
        return batch

    def take(self, order: list[int], derive: bool = True) -> SamplingBatch:
        """The rows ``order`` (indices of this batch, in that order: a filter, a permutation)."""
        index = long_tensor(order, self.device)
        infos = [self.infos[i] for i in order]
        penalties = None
        if self.penalties is not None:
            table_row, k = {}, 0  # table rows follow the batch rows' order
            for i, info in enumerate(self.infos):
                if info.penalized:
                    table_row[i] = k
                    k += 1
            kept = [table_row[i] for i in order if i in table_row]
            if kept:
                penalties = self.penalties.take(
                    kept, [j for j, info in enumerate(infos) if info.penalized])
        batch = SamplingBatch(self.vocab_size, self.floats.index_select(0, index),
                              self.ints.index_select(0, index), self.greedy.index_select(0, index),
                              infos, [self.lengths[i] for i in order], penalties)
        if derive:
            batch.derive()
        return batch

    @staticmethod
    def concat(a: SamplingBatch, b: SamplingBatch, derive: bool = True) -> SamplingBatch:
        """``a``'s rows, then ``b``'s."""
        batch = SamplingBatch(a.vocab_size, torch.cat([a.floats, b.floats]),
                              torch.cat([a.ints, b.ints]), torch.cat([a.greedy, b.greedy]),
                              a.infos + b.infos, a.lengths + b.lengths,
                              PenaltyTable.concat(a.penalties, b.penalties, a.size))
        if derive:
            batch.derive()
        return batch

    def derive(self) -> None:
        """The flags and row lists the sampler branches on, from the rows' infos."""
        infos, device = self.infos, self.device

        def rows(flags) -> torch.Tensor | None:
            picked = [k for k, flag in enumerate(flags) if flag]
            return long_tensor(picked, device) if picked else None

        greedy = [info.greedy for info in infos]
        self.all_greedy, self.any_greedy = all(greedy), any(greedy)
        self.filter_rows = rows(info.filters for info in infos)
        self.top_k = self.ints[:, TOP_K] if any(info.top_k for info in infos) else None
        self.top_p = self.floats[:, TOP_P] if any(info.top_p for info in infos) else None
        self.min_p = self.floats[:, MIN_P] if any(info.min_p for info in infos) else None
        self.seed_rows = rows(info.seeded for info in infos)
        ban_rows, ban_ids, steps = [], [], 0
        for k, (info, length) in enumerate(zip(infos, self.lengths)):
            if length < info.min_new_tokens and info.ban:
                ban_rows += [k] * len(info.ban)
                ban_ids += info.ban
                steps = max(steps, info.min_new_tokens - length)
        self.banned = None
        if ban_rows:
            self.banned = (long_tensor(ban_rows, device), long_tensor(ban_ids, device))
        self.ban_steps = steps
        asked = any(info.top_logprobs >= 0 for info in infos)
        self.top_logprobs = [info.top_logprobs for info in infos] if asked else None

    def advance(self, sampled: torch.Tensor) -> None:
        """The step's tokens were sampled (``sampled`` [B], on the device) and each row's
        request appends its own: move every row's state to its next output position."""
        with torch.inference_mode():  # (in place, whichever mode made the tensors)
            if self.penalties is not None:
                self.penalties.add(sampled)
            self.ints[:, POSITION] += 1
        self.lengths = list(map(_PLUS_ONE, self.lengths))  # (C-level: every row, every step)
        if self.banned is not None:
            self.ban_steps -= 1
            if self.ban_steps <= 0:
                self.banned = None

    def skip(self, counts: list[int]) -> bool:
        """Each row took ``counts[k]`` tokens without this batch seeing them (SamplingState.
        skip): positions and lengths move on. False (nothing changed) when a row's penalties
        count its tokens or a min_new_tokens ban is in force: then the batch must be rebuilt."""
        if self.penalties is not None or self.banned is not None:
            return False
        with torch.inference_mode():
            step = torch.tensor(counts, dtype=self.ints.dtype).to(self.ints.device)
            self.ints[:, POSITION] += step
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]
        return True

    def seed_uniform(self) -> torch.Tensor:
        """[S] float32: the seeded rows' draws for this step (a hash of seed and position)."""
        ints = self.ints.index_select(0, self.seed_rows)
        return counter_uniform(ints[:, SEED_KEY], ints[:, POSITION])
