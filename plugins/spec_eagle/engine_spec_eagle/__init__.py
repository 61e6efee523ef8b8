"""Speculative algorithms 'EAGLE' and 'EAGLE3' (vLLM: methods "eagle", "eagle3"): a draft
head reading the target's hidden states drafts greedy chains, or trees with
``--speculative-eagle-topk`` > 1 (``--speculative-draft-model-path``: an SGLang-format EAGLE /
EAGLE3 checkpoint); the core verifies them."""

from engine import hookimpl

ENGINE_HOOKS_VERSION = "1.5"  # register_speculative_algorithms, Drafter.hidden_states

ARCHS = {"EAGLE": ("LlamaForCausalLMEagle", "LlamaForCausalLM"),
         "EAGLE3": ("LlamaForCausalLMEagle3",)}


def _check_flags(s) -> None:
    from engine.speculative import check_chain_flags

    algo = s.algorithm
    check_chain_flags(s, "a head", f"an {algo} head's checkpoint trained for the target, "
                                   f"SGLang's format; vLLM: --speculative-config "
                                   f"'{{\"method\": \"{algo.lower()}\", \"model\": PATH}}'")


def aux_layers(hf: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs an EAGLE3 head reads, low to high: the head config's
    eagle_aux_hidden_state_layer_ids (top level or in eagle_config), else SGLang's default
    (the inputs of layers 2, L // 2 and L - 3, i.e. the outputs of 1, L // 2 - 1, L - 4)."""
    from engine.errors import EngineError

    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    given = ids is not None
    if ids is None:
        ids = [1, num_layers // 2 - 1, num_layers - 4]
    ids = [int(i) for i in ids]
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i < num_layers for i in ids):
        where = ("eagle_aux_hidden_state_layer_ids " + str(ids) if given
                 else f"SGLang's default layers {ids}")
        raise EngineError(f"EAGLE3 reads three distinct layers of the {num_layers}-layer target; "
                          f"{where} are not: give eagle_aux_hidden_state_layer_ids in the "
                          f"head's config.json")
    return tuple(sorted(ids))


def _head_config(path: str) -> dict:
    """The head's config.json ({} when it cannot be read here: the loader says why)."""
    import json
    import os

    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return {}
    return hf if isinstance(hf, dict) else {}


def _check_head(algo: str, path: str, hf: dict, tc) -> None:
    """The head's config against the algorithm and the target (``tc``: its ModelConfig)."""
    from engine.errors import EngineError

    arch = (hf.get("architectures") or [None])[0]
    if arch is not None and arch not in ARCHS[algo]:
        raise EngineError(f"--speculative-draft-model-path {path} is a {arch}; "
                          f"--speculative-algorithm {algo} reads {' or '.join(ARCHS[algo])} "
                          f"heads")
    for key, want in (("hidden_size", tc.hidden_size), ("target_hidden_size", tc.hidden_size),
                      ("vocab_size", tc.vocab_size)):
        got = hf.get(key, want)
        if got != want:
            what = key.replace("target_", "").replace("_", " ")
            raise EngineError(f"the {algo} head's {what} ({got}) differs from the target's "
                              f"({want}): it was trained for another model")


def _factory(ctx):
    from engine.errors import EngineError

    from engine_spec_eagle.drafter import EagleDrafter
    from engine_spec_eagle.heads import Eagle3Head, EagleHead

    s = ctx.settings
    _check_flags(s)
    algo, target = s.algorithm, ctx.target
    head_cls = Eagle3Head if algo == "EAGLE3" else EagleHead
    tc = target.model_config
    hf = _head_config(s.draft_model_path)
    _check_head(algo, s.draft_model_path, hf, tc)
    if algo == "EAGLE3" and hf:
        aux_layers(hf, tc.num_layers)  # refused before the head loads
    runner = ctx.load_model(s.draft_model_path, head_cls)
    mc = runner.model_config
    head = runner.model
    head.share(target.model)
    if algo == "EAGLE3":
        hidden = aux_layers(mc.hf_config, tc.num_layers)
        if head.draft_vocab is not None and head.draft_vocab != tc.vocab_size and \
                head.d2t is None:
            raise EngineError(f"the EAGLE3 head's draft vocabulary ({head.draft_vocab} tokens) "
                              f"needs its d2t tensor (draft id -> target id); the checkpoint "
                              f"has none")
        vocab = ("the target's LM head" if head.draft_vocab is None
                 else f"a draft vocabulary of {head.draft_vocab} tokens")
        what = f"EAGLE3 head over target layers {list(hidden)}, {vocab}"
    else:
        hidden = ("norm",)
        what = f"EAGLE head of {mc.num_layers} layer{'s' * (mc.num_layers > 1)}"
    from engine.speculative import tree_shape

    return EagleDrafter(runner, hidden, algo, f"{what} ({s.draft_model_path})", tree_shape(s))


@hookimpl
def register_speculative_algorithms(register):
    register("EAGLE", lambda ctx: _factory(ctx),
             description="an EAGLE head over the target's last hidden states drafts greedy "
                         "chains")
    register("EAGLE3", lambda ctx: _factory(ctx),
             description="an EAGLE3 head over three of the target's layers drafts greedy "
                         "chains")
