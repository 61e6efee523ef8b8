"""xgrammar behind engine's GrammarBackend: one GrammarCompiler per engine (thread-safe, so the
core's compile workers share it), one xgrammar GrammarMatcher per sequence."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from engine.grammar.parsing import LABELS, check_kind, eos_token_id, parse_choices, parse_schema
from engine.interfaces import Constraint, GrammarBackend, GrammarError, GrammarMatcher

# xgrammar's C++ errors start with "[22:06:48] /project/cpp/regex_converter.cc:83: " and its
# checks with "Check failed: (error.empty()) is false: ": neither helps the user
_NOISE = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def clean(error: Exception) -> str:
    text = _NOISE.sub("", str(error).strip())
    return text.split(" The JSON string is:")[0]  # xgrammar echoes the whole schema back


def clear_padding(bitmask, row: int, vocab_size: int) -> None:
    """xgrammar sets the last word's bits past ``vocab_size``: ids that do not exist."""
    if vocab_size % 32:
        bitmask[row, vocab_size // 32] &= (1 << vocab_size % 32) - 1


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer, vocab_size: int):
        eos = eos_token_id(tokenizer, "xgrammar")
        self.vocab_size, self.eos = vocab_size, eos
        detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=[eos])
        # xgrammar reads a special token such as <|endoftext|> as its literal text, which a JSON
        # string may hold; an empty entry is what marks a token special (never allowed)
        special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        vocab = [""] * vocab_size
        for token, i in tokenizer.get_vocab().items():
            if i < vocab_size and i not in special:
                vocab[i] = token
        self.info = xgr.TokenizerInfo.from_vocab_and_metadata(vocab, detected.dump_metadata())
        # the core runs compiles on its own workers and caches them: no second cache here
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        kind = check_kind(constraint)
        try:
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', strict_mode=False)
            if kind == "json_schema":
                return self.compiler.compile_json_schema(parse_schema(constraint))
            if kind == "regex":
                return self.compiler.compile_regex(constraint.spec)
            if kind == "ebnf":
                return self.compiler.compile_grammar(constraint.spec)
            # JSON string literals are EBNF string literals in xgrammar's grammar syntax
            literals = (json.dumps(c, ensure_ascii=False) for c in parse_choices(constraint))
            return self.compiler.compile_grammar("root ::= " + " | ".join(literals))
        except (RuntimeError, ValueError, TypeError) as e:
            if isinstance(e, GrammarError):
                raise
            raise GrammarError(f"{LABELS[kind]}: {clean(e)}", constraint.field) from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled), self.vocab_size)


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int):
        self.m, self.vocab_size = matcher, vocab_size

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)
        clear_padding(bitmask, row, self.vocab_size)

    def accept(self, token_id: int) -> bool:
        return self.m.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()
