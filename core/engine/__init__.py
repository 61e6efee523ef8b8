"""engine: an LLM inference server. Public names: Engine, SamplingParams, hookimpl."""

from engine.hookspecs import hookimpl

__all__ = ["Engine", "SamplingParams", "hookimpl"]
__version__ = "0.1.0"


def __getattr__(name):
    # heavy modules (torch) load only when asked for, so plugin discovery and the CLI stay fast
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    if name == "SamplingParams":
        from engine.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
