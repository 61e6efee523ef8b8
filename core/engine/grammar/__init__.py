"""Structured outputs: the grammar backend chosen at start, its compile cache and worker
threads, one matcher per request, and the token bitmask the sampler applies."""

from engine.grammar.bitmask import apply_token_bitmask, bitmask_words, new_bitmask, unpack_bitmask
from engine.grammar.compiler import GrammarCompiler, build_compiler
from engine.grammar.request import RequestGrammar

__all__ = ["GrammarCompiler", "RequestGrammar", "apply_token_bitmask", "bitmask_words",
           "build_compiler", "new_bitmask", "unpack_bitmask"]
