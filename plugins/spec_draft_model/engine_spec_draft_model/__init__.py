"""Speculative algorithm 'STANDALONE' (vLLM: method "draft_model"): a smaller model with the
target's tokenizer drafts greedy chains (``--speculative-draft-model-path``), or trees with
``--speculative-eagle-topk`` > 1; the core verifies them."""

from engine import hookimpl

ENGINE_HOOKS_VERSION = "1.4"  # register_speculative_algorithms


def _factory(ctx):
    from engine.speculative import ModelDrafter, check_chain_flags, tree_shape

    s = ctx.settings
    check_chain_flags(s, "a model", "a smaller model with the target's tokenizer; vLLM: "
                                    "--speculative-config '{\"model\": PATH}'")
    return ModelDrafter(ctx.load_model(s.draft_model_path), ctx.vocab_size,
                        name=f"draft model {s.draft_model_path}", tree=tree_shape(s))


@hookimpl
def register_speculative_algorithms(register):
    register("STANDALONE", _factory,
             description="a smaller model with the target's tokenizer drafts greedy chains (or "
                         "trees: --speculative-eagle-topk)")
