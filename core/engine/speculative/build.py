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


def make_spec_decoder(entry, settings: SpecSettings, runner, context_length: int):
    """The scheduler's SpecDecoder over the drafter ``entry`` builds."""
    from engine.speculative.verify import SpecDecoder

    ctx = DraftContext(settings, runner.model_config.vocab_size, runner.device.torch_device)
    return SpecDecoder(entry.obj(ctx), settings, context_length)


def spec_line(spec, entry) -> str:
    if spec is None:
        return "speculative decoding: off"
    s = spec.settings
    return (f"speculative decoding: {s.algorithm} ({entry.origin}; {spec.drafter.describe()}), "
            f"up to {s.max_drafts} drafts per request and step, verified in one forward; "
            f"drafts run where their measured acceptance pays for their cost")
