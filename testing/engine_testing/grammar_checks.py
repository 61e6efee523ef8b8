"""For grammar backends' tests (plugins/grammar_*/tests): the checks every GrammarBackend must
pass, written once. A plugin's test module subclasses ``GrammarBackendChecks`` with its factory
and its own error messages, and ``GrammarRegistrationChecks`` with its registration; pytest
collects the inherited tests in each subclass. The tokenizers come from the fixtures
``smollm2_tokenizer`` (the default model's) and ``tiny_tokenizer`` (a tiny trained one) of
``engine_testing.fixtures``."""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.interfaces import Constraint, GrammarError

TOKENIZERS = ("smollm2", "tiny")  # the <name>_tokenizer fixtures every check runs on
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
# kind, spec, what the message says: refused by engine.grammar.parsing, whatever the backend
PARSE_ERRORS = [
    ("json_schema", '{"type":', "JSON schema is not valid JSON"),
    ("json_schema", "[1]", "must be a JSON object"),
    ("choice", "[]", "non-empty JSON list of strings"),
    ("choice", '["a", 1]', "non-empty JSON list of strings"),
    ("choice", "red", "choice list is not valid JSON"),
]


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


class GrammarBackendChecks:
    """Every constraint kind walked token by token, invalid continuations masked, errors at
    compile time naming the field, and "models" that only follow the mask emitting valid output,
    on each of TOKENIZERS with a logits width padded past its vocabulary. A subclass sets
    ``factory`` (``factory(tokenizer, vocab_size) -> GrammarBackend``) and ``errors``: its
    backend's own (kind, spec, message) cases, run after PARSE_ERRORS."""

    factory = None
    errors: list[tuple[str, str, str]] = []

    @classmethod
    def build(cls, tokenizer, vocab_size: int):
        factory = cls.factory  # read off the class, a plain function stays unbound
        if factory is None:
            raise TypeError(f"{cls.__name__} must set `factory` to the grammar backend's "
                            f"factory(tokenizer, vocab_size)")
        return factory(tokenizer, vocab_size)

    def pytest_generate_tests(self, metafunc):
        if "says" in metafunc.fixturenames:
            metafunc.parametrize("kind,spec,says", PARSE_ERRORS + list(self.errors))

    @pytest.fixture(scope="class", params=TOKENIZERS)
    @classmethod
    def case(cls, request):
        """(tokenizer, vocab_size, backend) with vocab_size PAD past the tokenizer's."""
        tokenizer = request.getfixturevalue(f"{request.param}_tokenizer")
        vocab_size = len(tokenizer) + PAD
        return tokenizer, vocab_size, cls.build(tokenizer, vocab_size)

    @pytest.mark.parametrize("kind", list(CASES))
    def test_walks_a_valid_text_token_by_token_and_masks_an_invalid_one(self, case, kind):
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

    def test_bad_constraints_fail_at_compile_naming_the_field(self, case, kind, spec, says):
        backend = case[2]
        with pytest.raises(GrammarError) as e:
            backend.compile(Constraint(kind, spec, "response_format.json_schema"))
        assert e.value.field == "response_format.json_schema"
        assert says in str(e.value) and "/project/" not in str(e.value), str(e.value)

    def test_an_unknown_kind_fails_at_compile_naming_the_field(self, case):
        with pytest.raises(GrammarError, match="unknown constraint kind 'yaml'") as e:
            case[2].compile(Constraint("yaml", "a: 1", "response_format"))
        assert e.value.field == "response_format"

    def test_the_lowest_allowed_token_each_step_yields_valid_output(self, case):
        jsonschema = pytest.importorskip("jsonschema")
        tokenizer, vocab_size, backend = case
        text = follow_mask(backend, Constraint("json_schema", json.dumps(SCHEMA)), tokenizer,
                           vocab_size, min)
        jsonschema.validate(json.loads(text), SCHEMA)
        regex = r"(ab|cd)[0-9]{2,4}-x?"
        assert re.fullmatch(regex, follow_mask(backend, Constraint("regex", regex), tokenizer,
                                               vocab_size, min))

    @pytest.mark.parametrize("seed", range(3))
    def test_random_allowed_tokens_yield_valid_output(self, case, seed):
        jsonschema = pytest.importorskip("jsonschema")
        tokenizer, vocab_size, backend = case
        rng = random.Random(seed)
        text = follow_mask(backend, Constraint("json_schema", json.dumps(SCHEMA)), tokenizer,
                           vocab_size, rng.choice, steps=2000)
        jsonschema.validate(json.loads(text), SCHEMA)
        text = follow_mask(backend, Constraint("choice", CASES["choice"][0]), tokenizer,
                           vocab_size, rng.choice)
        assert text in json.loads(CASES["choice"][0])

    def test_matchers_of_one_compiled_grammar_are_independent(self, case):
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

    def test_compiles_concurrently(self, case):
        """The core compiles on worker threads: one backend, several constraints at once."""
        tokenizer, _, backend = case
        constraints = [Constraint("regex", f"[a-z]{{{n}}}") for n in range(1, 9)]
        with ThreadPoolExecutor(4) as pool:
            compiled = list(pool.map(backend.compile, constraints))
        for n, grammar in enumerate(compiled, 1):
            matcher = backend.matcher(grammar)
            for token in tokenizer.encode("z" * n, add_special_tokens=False):
                assert matcher.accept(token)
            assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated()

    def test_a_tokenizer_without_eos_is_refused_when_built(self, tiny_tokenizer):
        tokenizer = copy.deepcopy(tiny_tokenizer)
        tokenizer.eos_token = None
        with pytest.raises(ValueError, match="needs the tokenizer's EOS token"):
            self.build(tokenizer, len(tokenizer))


class GrammarRegistrationChecks:
    """How a grammar plugin registers, without its library: a subclass sets ``plugin`` (the
    plugin's module: its ``_factory`` and ``check``), ``name`` (its backend's name, which is also
    its library's and pip package's) and ``priority``; the distribution is
    ``engine-grammar-<name>``, in plugins/grammar_<name>."""

    plugin = None
    name = ""
    priority = 0

    def registered(self):
        calls = []
        self.plugin.register_grammar_backends(lambda *a, **kw: calls.append((a, kw)))
        return calls

    def test_registers_its_backend_with_its_priority(self):
        [((name, factory), kw)] = self.registered()
        assert name == self.name and factory is self.plugin._factory
        assert kw["check"] is self.plugin.check and kw["priority"] == self.priority
        assert kw["description"]

    def test_check_names_the_pip_command_when_the_library_is_missing(self, monkeypatch):
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == self.name else real(name, *a))
        assert self.plugin.check() == (f"needs the {self.name} library, which is not "
                                       f"installed: `pip install {self.name}`")

    def test_check_passes_where_the_library_is_installed(self):
        pytest.importorskip(self.name, reason=f"the {self.name} library is not installed")
        assert self.plugin.check() is None

    def test_plugin_is_registered_through_its_entry_point(self):
        dist = f"engine-grammar-{self.name}"
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{dist} is not installed: pip install -e plugins/grammar_{self.name}")
        from engine.plugins import get_registries

        entry = get_registries().grammar.get(self.name)
        assert entry.dist == dist and entry.extra["priority"] == self.priority
