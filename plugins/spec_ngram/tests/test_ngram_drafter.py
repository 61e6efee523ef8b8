"""The n-gram drafter: the longest recent match wins, drafts follow it, new tokens are indexed
as they come, nothing is drafted without a match, and flags it does not use are refused."""

from types import SimpleNamespace

import pytest
from engine.errors import EngineError
from engine.interfaces import Draft, DraftContext
from engine.speculative import SpecSettings
from engine_spec_ngram.drafter import NgramDrafter


def req(prompt, output=(), rid="r"):
    return SimpleNamespace(rid=rid, prompt_ids=list(prompt), output_ids=list(output))


def test_longest_most_recent_match_and_its_continuation():
    d = NgramDrafter(1, 4)
    # "7 8" occurs twice; "6 7 8" once, followed by 1 2: the longest match decides
    r = req([6, 7, 8, 1, 2, 9, 7, 8, 3, 4, 6, 7, 8])
    assert d.propose([r], [3]) == [Draft([1, 2, 9], 3)]
    # a single-token match: its most recent earlier occurrence
    r2 = req([5, 1, 2, 5, 3, 4, 5], rid="s")
    assert d.propose([r2], [2]) == [Draft([3, 4], 1)]


def test_outputs_are_indexed_as_they_come_and_max_tokens_caps():
    d = NgramDrafter(2, 3)
    r = req([10, 11, 12, 13, 14])
    assert d.propose([r], [4]) == [Draft([], 0)]  # "13 14" never seen before
    r.output_ids += [99, 10, 11]
    assert d.propose([r], [4]) == [Draft([12, 13, 14, 99], 2)]
    assert d.propose([r], [1]) == [Draft([12], 2)]
    assert d.propose([r], [0]) == [Draft([], 0)]
    d.release("r")
    assert "r" not in d.index


def test_min_window_and_foreign_flags():
    assert NgramDrafter(2, 4).propose([req([5, 1, 5])], [3]) == [Draft([], 0)]  # 1-token match only
    ok = SpecSettings("NGRAM", 5, ngram_min_match_window=2, ngram_max_match_window=6)
    d = NgramDrafter.from_context(DraftContext(ok, 100, "cpu"))
    assert (d.min_window, d.max_window) == (2, 6)
    bad = SpecSettings("NGRAM", 5, draft_model_path="/some/model")
    with pytest.raises(EngineError, match="--speculative-draft-model-path does not apply"):
        NgramDrafter.from_context(DraftContext(bad, 100, "cpu"))
