"""An engine's speculative decoding from its flags: the drafter's registry entry resolved
before anything loads (an unknown algorithm lists the installed ones), then the drafter and
the scheduler's ``SpecDecoder`` once the model is up, and the start log's line."""

from __future__ import annotations

from engine.errors import EngineError
from engine.interfaces import DraftContext
from engine.speculative.settings import SpecSettings, spec_settings


def resolve_speculative(regs, config):
    """(registry entry, settings), or (None, None) when speculation is off."""
    settings = spec_settings(config)
    if settings is None:
        return None, None
    # SGLang spells them in capitals; a plugin's name is matched in any case
    name = next((n.name for n in regs.speculative if n.name.upper() == settings.algorithm),
                settings.algorithm)
    entry = regs.speculative.get(name)  # unknown: lists the installed ones
    reason = entry.unavailable_reason(None)
    if reason is not None:
        raise EngineError(f"--speculative-algorithm {settings.algorithm} ({entry.origin}) "
                          f"cannot run here: {reason}")
    return entry, settings


def make_spec_decoder(entry, settings: SpecSettings, runner, context_length: int,
                      load_model=None):
    """The scheduler's SpecDecoder over the drafter ``entry`` builds (``load_model``: what
    the DraftContext loads draft models with, see ``draft_model_loader``). A drafter that
    reads the target's hidden states (``Drafter.hidden_states``) has the target keep them:
    its forwards then run eagerly."""
    from engine.speculative.verify import SpecDecoder

    ctx = DraftContext(settings, runner.model_config.vocab_size, runner.device.torch_device,
                       load_model, runner)
    drafter = entry.obj(ctx)
    if drafter.hidden_states:
        capture = getattr(runner, "capture_hidden", None)
        if capture is None:
            raise EngineError(f"--speculative-algorithm {settings.algorithm} reads the target's "
                              f"hidden states, which a target on several ranks does not hand "
                              f"over yet: serve it on one process")
        capture(drafter.hidden_states)
    return SpecDecoder(drafter, settings, context_length, runner)


def draft_model_loader(config, regs, device, resolved, sizing):
    """``load_model(path, model_cls=None)``: a draft model's runner on the target's device,
    dtype and attention backend, with a KV pool of the target's size and request rows (its CPU
    graph where one applies; a ``model_cls`` of a plugin's, a draft head, runs eagerly)."""

    def load_model(path: str, model_cls=None):
        from engine.cpu_graph.replay import build_cpu_graph
        from engine.models.checkpoint import open_checkpoint
        from engine.runner import build_runner

        if config.tp_size * config.pp_size > 1:
            raise EngineError("a draft model with --tp-size or --pp-size > 1 is not supported "
                              "yet: serve the target on one process for now")
        try:
            ckpt = open_checkpoint(path)
        except EngineError as e:  # already says what to give
            raise EngineError(f"--speculative-draft-model-path: {e}") from None
        except (OSError, ValueError) as e:
            raise EngineError(f"--speculative-draft-model-path {path}: cannot open it as a "
                              f"checkpoint ({e}); give an HF directory or a .gguf file") from None
        runner = build_runner(config, ckpt, regs, device, resolved.attention, resolved.kv,
                              None, model_cls=model_cls)
        runner.init_kv_pool(sizing.max_total_tokens, config.page_size,
                            sizing.max_running_requests, sizing.context_length)
        if model_cls is None:
            build_cpu_graph(runner, config, device)
        return runner

    return load_model


def spec_line(spec, entry) -> str:
    if spec is None:
        return "speculative decoding: off"
    s = spec.settings
    eager = ("; the target's forwards run eagerly (no CPU/CUDA graph) to hand the drafter its "
             "hidden states" if spec.drafter.hidden_states else "")
    return (f"speculative decoding: {s.algorithm} ({entry.origin}; {spec.drafter.describe()}), "
            f"up to {s.max_drafts} drafts per request and step, verified in one forward; "
            f"drafts run where their measured acceptance pays for their cost{eager}")
