"""Speculative algorithm 'STANDALONE' (vLLM: method "draft_model"): a smaller model with the
target's tokenizer drafts greedy chains (``--speculative-draft-model-path``), the core
verifies them."""

from engine import hookimpl

ENGINE_HOOKS_VERSION = "1.4"  # register_speculative_algorithms


def _factory(ctx):
    from engine.errors import EngineError
    from engine.speculative import ModelDrafter

    s = ctx.settings
    if not s.draft_model_path:
        raise EngineError("--speculative-algorithm STANDALONE needs "
                          "--speculative-draft-model-path (a smaller model with the target's "
                          "tokenizer; vLLM: --speculative-config '{\"model\": PATH}')")
    if s.eagle_topk not in (None, 1):
        raise EngineError(f"--speculative-eagle-topk {s.eagle_topk}: STANDALONE drafts chains "
                          f"(top-1); give 1 or leave it out")
    if s.num_steps is not None and s.num_steps != s.max_drafts:
        raise EngineError(
            f"--speculative-num-steps {s.num_steps} and --speculative-num-draft-tokens "
            f"{s.num_draft_tokens} disagree: a chain of N draft steps verifies N + 1 tokens")
    if (s.ngram_min_match_window, s.ngram_max_match_window, s.ngram_max_bfs_breadth) != \
            (None, None, None):
        raise EngineError("the --speculative-ngram-* flags are NGRAM's; STANDALONE drafts with "
                          "a model: drop them")
    return ModelDrafter(ctx.load_model(s.draft_model_path), ctx.vocab_size,
                        name=f"draft model {s.draft_model_path}")


@hookimpl
def register_speculative_algorithms(register):
    register("STANDALONE", _factory,
             description="a smaller model with the target's tokenizer drafts greedy chains")
