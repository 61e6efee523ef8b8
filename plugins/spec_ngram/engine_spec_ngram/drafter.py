"""The n-gram drafter: per request, an index from each n-gram of its tokens (n within the
match window) to where it last ended, kept up to date as tokens come; a proposal looks up the
request's last ``n`` tokens, longest ``n`` first, and drafts what followed their most recent
earlier occurrence. With ``--speculative-ngram-max-bfs-breadth`` b > 1 it drafts a tree
instead: what followed each earlier occurrence (of the longest match first, most recent first,
then of shorter ones) goes into a trie of at most b children per node, whose nodes are listed
likeliest first (parents before children) for the core to verify at once."""

from __future__ import annotations

from engine.errors import EngineError
from engine.interfaces import Draft, Drafter
from engine.speculative import NGRAM_WINDOW

NONE = Draft([], 0)


class _Index:
    """One request's tokens and n-gram index."""

    __slots__ = ("ends", "every", "indexed", "tokens")

    def __init__(self):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the position it last ended at
        self.every: dict[tuple[int, ...], list[int]] = {}  # (trees) -> every such position
        self.indexed = 0  # n-grams ending before this position are in ``ends``


TREE_ALPHA = 0.6  # the acceptance the tree's node order assumes (likeliest nodes first)
MAX_OCCURRENCES = 8  # earlier occurrences of one n-gram a tree draws on (most recent first)


class NgramDrafter(Drafter):
    def __init__(self, min_window: int, max_window: int, breadth: int = 1):
        self.min_window, self.max_window, self.breadth = min_window, max_window, breadth
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
        return cls(s.ngram_min_match_window or lo, s.ngram_max_match_window or hi,
                   s.ngram_max_bfs_breadth or 1)

    def describe(self) -> str:
        tree = f", trees of up to {self.breadth} branches a node" if self.breadth > 1 else ""
        return f"match window {self.min_window}-{self.max_window} tokens{tree}"

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
        lo, hi, ends, every = self.min_window, self.max_window, idx.ends, idx.every
        tree = self.breadth > 1
        # index the n-grams ending before the last token (the last one is the query)
        for end in range(idx.indexed, n_tok - 1):
            for n in range(lo, min(hi, end + 1) + 1):
                gram = tuple(toks[end - n + 1: end + 1])
                ends[gram] = end
                if tree:
                    every.setdefault(gram, []).append(end)
        idx.indexed = max(idx.indexed, n_tok - 1)
        if tree:
            return self._tree(toks, every, k)
        for n in range(min(hi, n_tok), lo - 1, -1):
            end = ends.get(tuple(toks[n_tok - n:]))
            if end is not None:  # kind: the match length
                return Draft(toks[end + 1: end + 1 + k], n)
        return NONE

    def _tree(self, toks: list[int], every: dict, k: int) -> Draft:
        """A trie of what followed the earlier occurrences of the last n tokens (longest n
        first, most recent first), at most ``breadth`` children a node, its nodes likeliest
        first (worth TREE_ALPHA ** depth x (1 - TREE_ALPHA) per earlier sibling), at most k."""
        n_tok = len(toks)
        trie: dict[int, dict[int, int]] = {-1: {}}  # node -> token -> child node
        tokens, parents, worth, kind = [], [], [], 0
        for n in range(min(self.max_window, n_tok), self.min_window - 1, -1):
            for end in reversed(every.get(tuple(toks[n_tok - n:]), [])[-MAX_OCCURRENCES:]):
                kind = kind or n
                at = -1
                for token in toks[end + 1: end + 1 + k]:
                    child = trie[at].get(token)
                    if child is None:
                        if len(trie[at]) >= self.breadth:
                            break
                        rank = len(trie[at])
                        child = len(tokens)
                        tokens.append(token)
                        parents.append(at)
                        worth.append((worth[at] if at >= 0 else 1.0) * TREE_ALPHA
                                     * (1 - TREE_ALPHA) ** rank)
                        trie[at][token] = child
                        trie[child] = {}
                    at = child
        if not tokens:
            return NONE
        # likeliest first; a child is worth less than its parent, so parents stay first
        order = sorted(range(len(tokens)), key=lambda j: (-worth[j], j))[:k]
        new = {old: i for i, old in enumerate(order)}
        return Draft([tokens[j] for j in order], kind,
                     [new[parents[j]] if parents[j] >= 0 else -1 for j in order])
