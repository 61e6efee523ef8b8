"""A model on disk as the engine reads it: a Hugging Face directory (config.json, safetensors,
tokenizer files: ``hf.py``) or a GGUF file, or a directory holding one (``gguf.py``, converted
once into a cache: ``gguf_cache.py``). Either way the loader sees what ``base.Checkpoint``
promises: an HF config dict, tensors under HF names and a transformers tokenizer."""

from __future__ import annotations

import os

from engine.errors import EngineError
from engine.models.checkpoint.base import Checkpoint
from engine.models.checkpoint.gguf import GGUFCheckpoint
from engine.models.checkpoint.hf import HFCheckpoint, load_tokenizer_dir, safetensors_files

__all__ = ["Checkpoint", "GGUFCheckpoint", "HFCheckpoint", "load_tokenizer_dir",
           "open_checkpoint", "safetensors_files"]


def open_checkpoint(path: str) -> Checkpoint:
    """A checkpoint for ``path``: an HF directory, a ``.gguf`` file, or a directory holding
    exactly one ``.gguf`` (and no config.json)."""
    if os.path.isfile(path):
        return GGUFCheckpoint(path)
    if not os.path.isdir(path):
        raise EngineError(f"Model path '{path}' does not exist (give a Hugging Face model "
                          f"directory or a .gguf file).")
    if os.path.isfile(os.path.join(path, "config.json")):
        return HFCheckpoint(path)
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return GGUFCheckpoint(os.path.join(path, ggufs[0]))
    if ggufs:
        raise EngineError(f"'{path}' holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); pass "
                          f"the one to serve as --model {os.path.join(path, ggufs[0])}.")
    raise EngineError(f"'{path}' has no config.json; point the model path at a Hugging Face "
                      f"model directory (config.json plus *.safetensors) or a .gguf file.")
