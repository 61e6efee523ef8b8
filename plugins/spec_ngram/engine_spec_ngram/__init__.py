"""Speculative algorithm 'NGRAM': draft the continuation of the longest recent match of a
request's last tokens in its own prompt and output (prompt lookup decoding; SGLang's NGRAM,
vLLM's "ngram" method, llama.cpp's lookup decoding). No model: drafting costs microseconds."""

from engine import hookimpl

ENGINE_HOOKS_VERSION = "1.4"  # register_speculative_algorithms


def _factory(ctx):
    from engine_spec_ngram.drafter import NgramDrafter

    return NgramDrafter.from_context(ctx)


@hookimpl
def register_speculative_algorithms(register):
    register("NGRAM", _factory,
             description="prompt/output lookup: the continuation of the longest recent match")
