"""Grammar backend 'xgrammar': structured outputs (JSON schema, regex, EBNF, choice) through
xgrammar's compiler and matcher. xgrammar is imported only when the backend is built, so that
`engine plugins` lists this plugin where the library is missing."""

import importlib.util

from engine import hookimpl

INSTALL = "pip install xgrammar"


def check():
    if importlib.util.find_spec("xgrammar") is None:
        return f"needs the xgrammar library, which is not installed: `{INSTALL}`"
    return None


def _factory(tokenizer, vocab_size):
    from engine_grammar_xgrammar.backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size)


@hookimpl
def register_grammar_backends(register):
    register("xgrammar", _factory, check=check, priority=20,
             description="xgrammar (pushdown automaton, precompiled token masks); the default")
