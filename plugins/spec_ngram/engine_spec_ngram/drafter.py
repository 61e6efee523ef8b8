"""The n-gram drafter: per request, an index from each n-gram of its tokens (n within the
match window) to where it last ended, kept up to date as tokens come; a proposal looks up the
request's last ``n`` tokens, longest ``n`` first, and drafts what followed their most recent
earlier occurrence."""

from __future__ import annotations

from engine.errors import EngineError
from engine.interfaces import Draft, Drafter
from engine.speculative import NGRAM_WINDOW

NONE = Draft([], 0)


class _Index:
    """One request's tokens and n-gram index."""

    __slots__ = ("ends", "indexed", "tokens")

    def __init__(self):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the position it last ended at
        self.indexed = 0  # n-grams ending before this position are in ``ends``


class NgramDrafter(Drafter):
    def __init__(self, min_window: int, max_window: int):
        self.min_window, self.max_window = min_window, max_window
        self.index: dict[str, _Index] = {}

    @classmethod
    def from_context(cls, ctx) -> NgramDrafter:
        s = ctx.settings
        for flag, value in (("--speculative-draft-model-path", s.draft_model_path),
                            ("--speculative-num-steps", s.num_steps),
                            ("--speculative-eagle-topk", s.eagle_topk)):
            if value is not None:
                raise EngineError(f"{flag} does not apply to --speculative-algorithm NGRAM "
                                  f"(it drafts by lookup, with no draft model): drop it, or "
                                  f"choose an algorithm that uses it (STANDALONE, EAGLE)")
        lo, hi = NGRAM_WINDOW
        return cls(s.ngram_min_match_window or lo, s.ngram_max_match_window or hi)

    def describe(self) -> str:
        return f"match window {self.min_window}-{self.max_window} tokens"

    def release(self, rid: str) -> None:
        self.index.pop(rid, None)

    def propose(self, reqs: list, max_tokens: list[int]) -> list[Draft]:
        return [self._propose(r, k) if k > 0 else NONE for r, k in zip(reqs, max_tokens)]

    def _propose(self, req, k: int) -> Draft:
        idx = self.index.get(req.rid)
        if idx is None:
            idx = self.index[req.rid] = _Index()
            idx.tokens = list(req.prompt_ids)
        toks = idx.tokens
        known = len(toks) - len(req.prompt_ids)
        if known < len(req.output_ids):
            toks.extend(req.output_ids[known:])
        n_tok = len(toks)
        lo, hi, ends = self.min_window, self.max_window, idx.ends
        # index the n-grams ending before the last token (the last one is the query)
        for end in range(idx.indexed, n_tok - 1):
            for n in range(lo, min(hi, end + 1) + 1):
                ends[tuple(toks[end - n + 1: end + 1])] = end
        idx.indexed = max(idx.indexed, n_tok - 1)
        for n in range(min(hi, n_tok), lo - 1, -1):
            end = ends.get(tuple(toks[n_tok - n:]))
            if end is not None:  # kind: the match length
                return Draft(toks[end + 1: end + 1 + k], n)
        return NONE
