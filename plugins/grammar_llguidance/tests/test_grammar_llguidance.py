"""Grammar backend 'llguidance' on the default model's tokenizer (SmolLM2) and a tiny trained one,
with a logits width padded past the tokenizer's vocabulary: every constraint kind walked token
by token, invalid continuations masked, errors at compile time naming the field, and "models"
that only follow the mask (the lowest allowed token, or a random one) emitting valid output."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("llguidance", reason="the llguidance library is not installed: "
                                         "pip install llguidance")

from engine.interfaces import Constraint, GrammarError  # noqa: E402
from engine_grammar_llguidance.backend import LLGuidanceBackend  # noqa: E402

PAD = 40  # logits wider than the vocabulary (as Phi-3's): ids past the tokenizer's never allowed
SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 2},
                         "ok": {"type": "boolean"},
                         "pet": {"$ref": "#/$defs/pet"}},
          "required": ["name", "age", "tags", "ok", "pet"],
          "$defs": {"pet": {"anyOf": [{"type": "null"}, {"const": "cat"}]}}}
# kind, spec, a text it accepts, a text whose first token it refuses at the start
CASES = {
    "json_schema": (json.dumps(SCHEMA),
                    '{"name": "Bob", "age": 42, "tags": ["a", "b"], "ok": true, "pet": null}',
                    '["Bob"]'),
    "json_object": ("", '{"x": [1, 2.5, {"y": null}], "z": "w"}', "[1]"),
    "regex": (r"\d{3}-[a-z]+", "123-abc", "x1"),
    "ebnf": ('root ::= "yes" | "no" [0-9]+', "no42", "maybe"),
    "choice": (json.dumps(["red", "green", 'say "hi"\n']), 'say "hi"\n', "yellow"),
}
BACKEND = LLGuidanceBackend
ERRORS = [  # kind, spec, what the message says
    ("json_schema", '{"type":', "JSON schema is not valid JSON"),
    ("json_schema", "[1]", "must be a JSON object"),
    ("json_schema", '{"type": "nonsense"}', "Invalid type: nonsense"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "'/$defs/missing' does not exist"),
    # features llguidance does not support: "not", and look-around in a pattern
    ("json_schema", '{"not": {"type": "string"}}', 'Unimplemented keys: ["not"]'),
    ("json_schema", '{"type": "string", "pattern": "(?<=a)b"}', "look-behind, is not supported"),
    ("regex", "(ab", "unclosed group"),
    ("regex", "a{3,2}", "invalid repetition count range"),
    ("ebnf", "root ::= foo", "Rule 'foo' not found"),
    ("ebnf", "start: foo", 'unknown name: "foo"'),
    ("choice", "[]", "non-empty JSON list of strings"),
    ("choice", '["a", 1]', "non-empty JSON list of strings"),
    ("choice", "red", "choice list is not valid JSON"),
]


@pytest.fixture(scope="module", params=["smollm2", "tiny"])
def case(request):
    tokenizer = request.getfixturevalue(f"{request.param}_tokenizer")
    vocab_size = len(tokenizer) + PAD
    return tokenizer, vocab_size, BACKEND(tokenizer, vocab_size)


def allowed(bitmask: torch.Tensor, row: int) -> list[int]:
    words = bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)
    return words.bitwise_and(1).view(-1).nonzero().view(-1).tolist()  # padding bits too


def step_mask(matcher, tokenizer, vocab_size, rows=3, row=1) -> list[int]:
    """Fill one row of a batch's bitmask; the other rows stay as they were."""
    bitmask = torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, row)
    assert not bitmask[:row].any() and not bitmask[row + 1:].any()
    ids = allowed(bitmask, row)
    special = set(tokenizer.all_special_ids) - {tokenizer.eos_token_id}
    assert ids and not [i for i in ids if i >= len(tokenizer) or i in special]
    return ids


@pytest.mark.parametrize("kind", list(CASES))
def test_walks_a_valid_text_token_by_token_and_masks_an_invalid_one(case, kind):
    tokenizer, vocab_size, backend = case
    spec, valid, invalid = CASES[kind]
    matcher = backend.matcher(backend.compile(Constraint(kind, spec, "f")))
    eos = tokenizer.eos_token_id
    bad = tokenizer.encode(invalid, add_special_tokens=False)[0]
    first = step_mask(matcher, tokenizer, vocab_size)
    assert bad not in first and eos not in first
    assert not matcher.accept(bad) and not matcher.accept(eos)  # refused, and nothing moved
    for token in tokenizer.encode(valid, add_special_tokens=False):
        assert token in step_mask(matcher, tokenizer, vocab_size), tokenizer.decode([token])
        assert matcher.accept(token) and not matcher.is_terminated()
    last = step_mask(matcher, tokenizer, vocab_size)
    assert eos in last
    if kind == "choice":
        assert last == [eos]
    assert matcher.accept(eos) and matcher.is_terminated()
    assert not matcher.accept(first[0])


@pytest.mark.parametrize("kind,spec,says", ERRORS)
def test_bad_constraints_fail_at_compile_naming_the_field(case, kind, spec, says):
    backend = case[2]
    with pytest.raises(GrammarError) as e:
        backend.compile(Constraint(kind, spec, "response_format.json_schema"))
    assert e.value.field == "response_format.json_schema"
    assert says in str(e.value) and "/project/" not in str(e.value), str(e.value)


def test_reads_lark_grammars_too(case):
    tokenizer, vocab_size, backend = case
    lark = 'start: "n=" NUM\nNUM: /[0-9]+/'
    matcher = backend.matcher(backend.compile(Constraint("ebnf", lark)))
    for token in tokenizer.encode("n=42", add_special_tokens=False):
        assert token in step_mask(matcher, tokenizer, vocab_size) and matcher.accept(token)
    assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated()


def follow_mask(backend, constraint, tokenizer, vocab_size, pick, steps=600) -> str:
    """A "model" whose only guide is the mask: ``pick`` chooses among the allowed ids."""
    matcher, out = backend.matcher(backend.compile(constraint)), []
    for _ in range(steps):
        token = pick(step_mask(matcher, tokenizer, vocab_size))
        assert matcher.accept(token)
        if matcher.is_terminated():
            assert token == tokenizer.eos_token_id
            return tokenizer.decode(out)
        out.append(token)
    raise AssertionError(f"not terminated after {steps} tokens: {tokenizer.decode(out)!r}")


def test_the_lowest_allowed_token_each_step_yields_valid_output(case):
    jsonschema = pytest.importorskip("jsonschema")
    tokenizer, vocab_size, backend = case
    text = follow_mask(backend, Constraint("json_schema", json.dumps(SCHEMA)), tokenizer,
                       vocab_size, min)
    jsonschema.validate(json.loads(text), SCHEMA)
    regex = r"(ab|cd)[0-9]{2,4}-x?"
    assert re.fullmatch(regex, follow_mask(backend, Constraint("regex", regex), tokenizer,
                                           vocab_size, min))


@pytest.mark.parametrize("seed", range(3))
def test_random_allowed_tokens_yield_valid_output(case, seed):
    jsonschema = pytest.importorskip("jsonschema")
    tokenizer, vocab_size, backend = case
    rng = random.Random(seed)
    text = follow_mask(backend, Constraint("json_schema", json.dumps(SCHEMA)), tokenizer,
                       vocab_size, rng.choice, steps=2000)
    jsonschema.validate(json.loads(text), SCHEMA)
    text = follow_mask(backend, Constraint("choice", CASES["choice"][0]), tokenizer,
                       vocab_size, rng.choice)
    assert text in json.loads(CASES["choice"][0])


def test_matchers_of_one_compiled_grammar_are_independent(case):
    tokenizer, vocab_size, backend = case
    compiled = backend.compile(Constraint("regex", r"[a-z]+ [0-9]+"))
    texts = ["abc 1", "xy 2024", "q 7"]
    matchers = [backend.matcher(compiled) for _ in texts]
    streams = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    bitmask = torch.zeros(len(texts), (vocab_size + 31) // 32, dtype=torch.int32)
    for i in range(max(map(len, streams)) + 1):  # one batch: every row filled each step
        live = [r for r, m in enumerate(matchers) if not m.is_terminated()]
        for r in live:
            matchers[r].fill_bitmask(bitmask, r)
        for r in live:
            token = streams[r][i] if i < len(streams[r]) else tokenizer.eos_token_id
            assert token in allowed(bitmask, r) and matchers[r].accept(token)
    assert all(m.is_terminated() for m in matchers)


def test_compiles_concurrently(case):
    """The core compiles on worker threads: one backend, several constraints at once."""
    backend = case[2]
    constraints = [Constraint("regex", f"[a-z]{{{n}}}") for n in range(1, 9)]
    with ThreadPoolExecutor(4) as pool:
        compiled = list(pool.map(backend.compile, constraints))
    tokenizer = case[0]
    for n, grammar in enumerate(compiled, 1):
        matcher = backend.matcher(grammar)
        for token in tokenizer.encode("z" * n, add_special_tokens=False):
            assert matcher.accept(token)
        assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated()


def test_a_tokenizer_without_eos_is_refused_when_built(tiny_tokenizer):
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="needs the tokenizer's EOS token"):
        BACKEND(tokenizer, len(tokenizer))


def test_logits_narrower_than_the_vocabulary_are_refused_when_built(tiny_tokenizer):
    with pytest.raises(ValueError, match="cannot use this tokenizer with the model's vocabulary "
                                         "of 500 tokens.*try --grammar-backend xgrammar"):
        BACKEND(tiny_tokenizer, 500)
