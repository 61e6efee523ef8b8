"""llguidance behind engine's GrammarBackend. A compile builds and checks one LLMatcher (the
grammar parsed, its errors found); each sequence gets a deep copy of it, which is cheap."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf

from engine.grammar.parsing import LABELS, check_kind, eos_token_id, parse_choices, parse_schema
from engine.interfaces import Constraint, GrammarBackend, GrammarError, GrammarMatcher

def grammar_text(constraint: Constraint) -> str:
    """The constraint as llguidance's grammar definition (not checked yet)."""
    kind = check_kind(constraint)
    if kind == "json_object":
        return llguidance.grammar_from("json_schema", '{"type": "object"}')
    if kind == "json_schema":
        return llguidance.grammar_from("json_schema", parse_schema(constraint))
    if kind == "regex":
        return llguidance.grammar_from("regex", constraint.spec)
    if kind == "ebnf":  # GBNF, or Lark as llguidance reads it
        return llguidance.grammar_from("ebnf", constraint.spec)
    # choice: an alternation of JSON-quoted literals, which Lark reads as strings
    return llguidance.grammar_from("choice", json.dumps(parse_choices(constraint)))


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer, vocab_size: int):
        eos = eos_token_id(tokenizer, "llguidance")
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                          eos_token=eos)
        except ValueError as e:
            raise ValueError(f"grammar backend 'llguidance' cannot use this tokenizer with the "
                             f"model's vocabulary of {vocab_size} tokens: {e}; try "
                             f"--grammar-backend xgrammar") from None
        self.vocab_size, self.eos = vocab_size, eos

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        try:
            grammar = grammar_text(constraint)
        except ValueError as e:
            if isinstance(e, GrammarError):
                raise
            raise GrammarError(f"{LABELS[constraint.kind]}: {e}", constraint.field) from None
        # log_level=0: its errors come back through get_error(), not stderr
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{LABELS[constraint.kind]}: {matcher.get_error().strip()}",
                               constraint.field)
        return matcher

    def matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self.eos)


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher, eos: int):
        self.m, self.eos = matcher, eos
        # llguidance stops as soon as nothing but EOS can follow; like xgrammar, the sequence
        # ends only when the EOS token itself is accepted
        self.terminated = False

    def fill_bitmask(self, bitmask, row: int) -> None:
        assert not self.terminated, "fill_bitmask after the grammar terminated"
        words = bitmask[row]
        assert bitmask.dtype.itemsize == 4 and words.is_contiguous() and words.device.type == "cpu"
        self.m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept(self, token_id: int) -> bool:
        # a rejected token would leave llguidance in a permanent error state: check it first,
        # so a refusal leaves the matcher where it was (as xgrammar's does)
        if self.terminated:
            return False
        if token_id == self.eos:  # validate_tokens never counts EOS; it is allowed at an end
            if not self.m.is_accepting():
                return False
        elif self.m.validate_tokens([token_id]) != 1:
            return False
        if not self.m.consume_token(token_id):
            return False
        self.terminated = token_id == self.eos
        return True

    def is_terminated(self) -> bool:
        return self.terminated
