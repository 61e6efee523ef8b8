"""Grammar backend 'llguidance': structured outputs (JSON schema, regex, Lark/GBNF grammars,
choice) through llguidance's matcher. llguidance is imported only when the backend is built, so
that `engine plugins` lists this plugin where the library is missing."""

import importlib.util

from engine import hookimpl

INSTALL = "pip install llguidance"


def check():
    if importlib.util.find_spec("llguidance") is None:
        return f"needs the llguidance library, which is not installed: `{INSTALL}`"
    return None


def _factory(tokenizer, vocab_size):
    from engine_grammar_llguidance.backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size)


@hookimpl
def register_grammar_backends(register):
    register("llguidance", _factory, check=check, priority=10,
             description="llguidance (Earley parser over a lexer, token masks on the fly)")
