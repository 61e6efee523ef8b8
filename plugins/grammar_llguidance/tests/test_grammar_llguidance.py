"""Grammar backend 'llguidance' through the checks every backend passes
(engine_testing.grammar_checks: every constraint kind walked token by token on SmolLM2's and a
tiny tokenizer, invalid continuations masked, errors at compile time naming the field, "models"
that only follow the mask emitting valid output), with llguidance's own error messages, and what
only llguidance does: Lark grammars, and a logits width narrower than the vocabulary refused."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance", reason="the llguidance library is not installed: "
                                         "pip install llguidance")

from engine.interfaces import Constraint  # noqa: E402
from engine_testing.grammar_checks import GrammarBackendChecks, step_mask  # noqa: E402
from engine_grammar_llguidance.backend import LLGuidanceBackend  # noqa: E402


class TestLLGuidance(GrammarBackendChecks):
    factory = LLGuidanceBackend
    errors = [  # kind, spec, what the message says (after grammar_checks.PARSE_ERRORS)
        ("json_schema", '{"type": "nonsense"}', "Invalid type: nonsense"),
        ("json_schema", '{"$ref": "#/$defs/missing"}', "'/$defs/missing' does not exist"),
        # features llguidance does not support: "not", and look-around in a pattern
        ("json_schema", '{"not": {"type": "string"}}', 'Unimplemented keys: ["not"]'),
        ("json_schema", '{"type": "string", "pattern": "(?<=a)b"}',
         "look-behind, is not supported"),
        ("regex", "(ab", "unclosed group"),
        ("regex", "a{3,2}", "invalid repetition count range"),
        ("ebnf", "root ::= foo", "Rule 'foo' not found"),
        ("ebnf", "start: foo", 'unknown name: "foo"'),
    ]

    def test_reads_lark_grammars_too(self, case):
        tokenizer, vocab_size, backend = case
        lark = 'start: "n=" NUM\nNUM: /[0-9]+/'
        matcher = backend.matcher(backend.compile(Constraint("ebnf", lark)))
        for token in tokenizer.encode("n=42", add_special_tokens=False):
            assert token in step_mask(matcher, tokenizer, vocab_size) and matcher.accept(token)
        assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated()

    def test_logits_narrower_than_the_vocabulary_are_refused_when_built(self, tiny_tokenizer):
        with pytest.raises(ValueError, match="cannot use this tokenizer with the model's "
                                             "vocabulary of 500 tokens.*try --grammar-backend "
                                             "xgrammar"):
            LLGuidanceBackend(tiny_tokenizer, 500)
