"""Structured outputs in the core, through a pure-Python "choice" backend
(tests/fixtures/engine_grammar_toy.py): resolution of --grammar-backend, the vectorized
bitmask, the sampler's mask, and the scheduler: compiles off the critical path, one matcher per
sample, termination before max_tokens, errors that fail one request only."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import pytest
import torch

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
sys.path.insert(0, FIXTURES)
import engine_grammar_toy as toy  # noqa: E402

from engine import Engine, hookimpl  # noqa: E402
from engine.engine import RequestError  # noqa: E402
from engine.grammar import apply_token_bitmask, bitmask_words  # noqa: E402
from engine.interfaces import Constraint, GrammarError  # noqa: E402
from engine.plugins import registries_with  # noqa: E402
from engine.registry import (BackendUnavailable, UnknownName,  # noqa: E402
                             resolve_grammar_backend)
from engine.sampling import (Sampler, SamplingBatch, SamplingParams,  # noqa: E402
                             SamplingParamsError)

CHOICES = ["yes", "no", "maybe later"]


def choice(options=CHOICES, field="guided_choice") -> Constraint:
    return Constraint("choice", json.dumps(options), field)


# -- the bitmask --------------------------------------------------------------------------------
def loop_mask(logits, bitmask, rows):
    out = logits.clone()
    for k, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word = int(bitmask[k, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [64, 100, 161])
def test_bitmask_application_equals_a_plain_loop(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31, (3, bitmask_words(vocab)), generator=gen,
                            dtype=torch.int64).int()
    bitmask[0, -1] = -1  # the sign bit set: bits past the vocabulary must not matter
    rows = [4, 0, 2]
    expected = loop_mask(logits, bitmask, rows)
    got = apply_token_bitmask(logits.clone(), bitmask, torch.tensor(rows))
    assert torch.equal(got, expected)
    whole = torch.randint(-2**31, 2**31, (5, bitmask_words(vocab)), generator=gen,
                          dtype=torch.int64).int()
    assert torch.equal(apply_token_bitmask(logits.clone(), whole),
                       loop_mask(logits, whole, range(5)))


def one_hot_mask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    bits = torch.zeros(len(allowed), bitmask_words(vocab) * 32, dtype=torch.int64)
    for k, tokens in enumerate(allowed):
        bits[k, tokens] = 1
    packed = (bits.view(len(allowed), -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).int()


def test_sampler_masks_before_temperature_and_top_k_and_leaves_other_rows_alone():
    V = 50
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=5.0),
              SamplingParams(temperature=0)]
    batch = SamplingBatch.build(params, [[1]] * 3, [[]] * 3, [None] * 3, [], V)
    allowed = [[t for t in range(V) if t % 7 == 3 and t != best[0]], [11, 12]]
    batch.allowed = (torch.tensor([0, 1]), one_hot_mask(allowed, V))
    tokens = Sampler()(logits.clone(), batch).next_token_ids.tolist()
    assert tokens[0] == max(allowed[0], key=lambda t: logits[0, t])  # best allowed, greedy
    assert tokens[1] == max(allowed[1], key=lambda t: logits[1, t])  # top-k sees the mask
    assert tokens[2] == best[2]  # an unconstrained row: unchanged


# -- params and resolution ----------------------------------------------------------------------
def test_sampling_params_take_at_most_one_constraint():
    assert SamplingParams.from_dict({"regex": "a+"}).constraint() == Constraint("regex", "a+",
                                                                                "regex")
    assert SamplingParams().constraint() is None
    with pytest.raises(SamplingParamsError, match="json_schema and ebnf both constrain"):
        SamplingParams.from_dict({"json_schema": "{}", "ebnf": "root ::= 'a'"})
    with pytest.raises(SamplingParamsError, match="regex must be a string"):
        SamplingParams.from_dict({"regex": 5})


class TwoBackends:
    @hookimpl
    def register_grammar_backends(self, register):
        register("low", toy.ChoiceBackend, priority=1)
        register("high", toy.ChoiceBackend, priority=5)
        register("broken", toy.ChoiceBackend, priority=9,
                 check=lambda: "needs libfoo: pip install foo")


def test_resolution_auto_none_named_unusable_and_missing():
    _, regs = registries_with(TwoBackends())
    assert resolve_grammar_backend(regs, "auto").name == "high"  # usable, highest priority
    assert resolve_grammar_backend(regs, "none") is None
    assert resolve_grammar_backend(regs, "low").name == "low"
    with pytest.raises(BackendUnavailable, match="'broken' .* unusable here: needs libfoo"):
        resolve_grammar_backend(regs, "broken")
    _, bare = registries_with()
    assert resolve_grammar_backend(bare, "auto") is None  # nothing installed: off, and logged
    with pytest.raises(UnknownName, match=r"pip install \./plugins/grammar_xgrammar"):
        resolve_grammar_backend(bare, "xgrammar")


# -- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    with toy.registered_globally(toy, "toy_grammar"):
        yield Engine(tiny_model_factory("llama"), max_total_tokens=4000,
                     grammar_backend="toy_choice")


def run(engine, reqs, limit=400):
    for _ in range(limit):
        if all(r.finished for r in reqs):
            return [engine.output(r) for r in reqs]
        engine.step()
    raise AssertionError("requests did not finish")


def test_start_log_names_the_backend(tiny_model_factory, caplog):
    with toy.registered_globally(toy, "toy_grammar"), caplog.at_level(logging.INFO, "engine"):
        Engine(tiny_model_factory("llama"), max_total_tokens=500, grammar_backend="toy_choice")
        off = Engine(tiny_model_factory("llama"), max_total_tokens=500, grammar_backend="none")
    assert "grammar backend: toy_choice (" in caplog.text
    assert "grammar backend: none (--grammar-backend none" in caplog.text
    with pytest.raises(RequestError, match="guided_choice: structured outputs are off.*"
                                           "--grammar-backend none"):
        off.add_request("hi", {"max_new_tokens": 4}, constraint=choice())


def test_each_sample_follows_its_own_matcher_and_stops_before_max_tokens(engine):
    reqs = engine.add_request("the quick brown fox", {"temperature": 1.0, "n": 4, "seed": 3,
                                                      "max_new_tokens": 40}, constraint=choice())
    outs = run(engine, reqs)
    assert len({id(r.grammar.matcher) for r in reqs}) == 4
    for out in outs:
        assert out["text"] in CHOICES
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 1}  # EOS
        assert out["meta_info"]["completion_tokens"] < 40
    assert len({o["text"] for o in outs}) > 1  # independent samples, not one matcher shared


def test_greedy_constrained_output_and_an_unconstrained_neighbour_unchanged(engine):
    free = {"temperature": 0.8, "seed": 11, "max_new_tokens": 12, "ignore_eos": True}
    alone = engine.generate("import sys", free)["output_ids"]
    constrained = engine.add_request("hello there", {"temperature": 0, "max_new_tokens": 30},
                                     constraint=choice(["blue", "green"]))
    neighbour = engine.add_request("import sys", free)
    outs = run(engine, constrained + neighbour)
    assert outs[0]["text"] in ("blue", "green")
    assert outs[1]["output_ids"] == alone


def test_offline_generate_with_sglang_fields_refuses_a_bad_constraint_up_front(engine):
    with pytest.raises(GrammarError, match="does not support regex") as err:
        engine.generate("hi", {"regex": "[a-z]+", "max_new_tokens": 5})
    assert err.value.field == "regex"
    assert not engine.scheduler.has_work


def test_a_failed_compile_fails_only_its_request(engine):
    bad = engine.add_request("hi", {"max_new_tokens": 8}, constraint=choice(["é"]))
    good = engine.add_request("hi", {"max_new_tokens": 3, "ignore_eos": True})
    outs = run(engine, bad + good)
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "error"
    assert "guided_choice" in bad[0].error and "cannot be spelled" in bad[0].error
    assert outs[1]["meta_info"]["completion_tokens"] == 3


def test_a_slow_compile_blocks_no_one(engine):
    backend = engine.grammar.backend
    backend.compile_delay = 2.0
    try:
        slow = engine.add_request("hi", {"max_new_tokens": 20},
                                  constraint=choice(["left", "right"]))
        fast = engine.add_request("hello", {"max_new_tokens": 4, "ignore_eos": True})
        start = time.monotonic()
        run(engine, fast)
        assert time.monotonic() - start < 1.5
        assert not slow[0].finished and slow[0].grammar.compiling
        assert slow[0].output_ids == []
        assert run(engine, slow)[0]["text"] in ("left", "right")
    finally:
        backend.compile_delay = 0.0


def test_compiles_are_cached_by_constraint(engine):
    before = engine.grammar.compiles
    for _ in range(3):
        engine.add_request("a", {"max_new_tokens": 10}, constraint=choice(["cached", "x"]))
    run(engine, engine.scheduler.waiting[:])
    assert engine.grammar.compiles == before + 1


def test_a_rejected_token_fails_that_request_with_a_clear_error(engine, monkeypatch):
    reqs = engine.add_request("hi", {"max_new_tokens": 20}, constraint=choice(["no", "nope"]))
    other = engine.add_request("ho", {"max_new_tokens": 5, "ignore_eos": True})
    monkeypatch.setattr(toy.ChoiceMatcher, "accept", lambda self, token: False)
    outs = run(engine, reqs + other)
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "error"
    assert "rejected token" in reqs[0].error and "toy_choice" in reqs[0].error
    assert outs[1]["meta_info"]["completion_tokens"] == 5
    engine.scheduler.check_invariants()


def test_cli_grammar_backend_flag_names_what_to_install():
    from click.testing import CliRunner
    from engine_cli.main import cli

    help_text = CliRunner().invoke(cli, ["serve", "--help"]).output
    assert "--grammar-backend" in help_text and "auto|none" in help_text
    result = CliRunner().invoke(cli, ["serve", "--grammar-backend", "llguidanse"])
    assert result.exit_code == 2
    assert "Unknown grammar backend 'llguidanse'" in result.output
