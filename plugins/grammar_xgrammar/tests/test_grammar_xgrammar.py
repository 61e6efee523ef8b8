"""Grammar backend 'xgrammar' through the checks every backend passes
(engine_testing.grammar_checks: every constraint kind walked token by token on SmolLM2's and a tiny
tokenizer, invalid continuations masked, errors at compile time naming the field, "models" that only
follow the mask emitting valid output), with xgrammar's own error messages, and what only xgrammar
does: a logits width narrower than the tokenizer's vocabulary."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("xgrammar", reason="the xgrammar library is not installed: "
                                       "pip install xgrammar")

from engine.interfaces import Constraint  # noqa: E402
from engine_testing.grammar_checks import GrammarBackendChecks  # noqa: E402
from engine_grammar_xgrammar.backend import XGrammarBackend  # noqa: E402


class TestXGrammar(GrammarBackendChecks):
    factory = XGrammarBackend
    errors = [  # kind, spec, what the message says (after grammar_checks.PARSE_ERRORS)
        ("json_schema", '{"type": "nonsense"}', 'Unsupported type "nonsense"'),
        ("json_schema", '{"$ref": "#/$defs/missing"}', "Cannot find field"),
        # a feature xgrammar does not support: look-behind in a string's pattern
        ("json_schema", '{"type": "string", "pattern": "(?<=a)b"}',
         "Lookbehind is not supported"),
        ("regex", "(ab", "The parenthesis is not closed"),
        ("regex", "a{3,2}", "Lower bound is larger than upper bound"),
        ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
        ("ebnf", 'root ::= "a" |', "Expect element"),
    ]

    def test_logits_narrower_than_the_vocabulary_never_allow_the_ids_past_them(
            self, tiny_tokenizer):
        vocab_size = len(tiny_tokenizer) - 12  # a model that dropped the tokenizer's last tokens
        backend = XGrammarBackend(tiny_tokenizer, vocab_size)
        matcher = backend.matcher(backend.compile(Constraint("json_object", "")))
        bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        for token in tiny_tokenizer.encode('{"a": 1}', add_special_tokens=False):
            matcher.fill_bitmask(bitmask, 0)
            ids = (bitmask[0].unsqueeze(-1) >> torch.arange(32)).bitwise_and(1).view(-1).nonzero()
            assert ids.max() < vocab_size and token in ids and matcher.accept(token)
