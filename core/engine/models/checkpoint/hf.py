"""A Hugging Face model directory: config.json, safetensors weights (sharded with an index, or
not) and the tokenizer files."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

from engine.errors import EngineError
from engine.models.checkpoint.base import Checkpoint, Keep

INDEX_FILE = "model.safetensors.index.json"


def read_config_json(path: str) -> dict:
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise EngineError(f"{path} is not valid JSON: {exc}") from None


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
        if missing:
            raise EngineError(f"{index} lists shards that are not in the directory: "
                              f"{', '.join(missing)}.")
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        others = [f for f in os.listdir(model_dir) if f.endswith((".bin", ".pt", ".pth"))]
        hint = (f" It has {', '.join(others[:3])}: convert the weights to safetensors."
                if others else "")
        raise EngineError(f"'{model_dir}' has no *.safetensors weights.{hint}")
    return [os.path.join(model_dir, f) for f in files]


def iter_safetensors(files: list[str], keep: Keep | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


class HFCheckpoint(Checkpoint):
    format = "hf"
    mismatch_hint = "does config.json match the weights?"

    def __init__(self, model_dir: str):
        super().__init__()
        self.path = model_dir
        self.config_source = os.path.join(model_dir, "config.json")
        self.hf_config = read_config_json(self.config_source)

    def tensors(self, dtype: torch.dtype, keep: Keep | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        # copied into dtype by the loader
        return iter_safetensors(safetensors_files(self.path), keep)

    def load_tokenizer(self):
        return load_tokenizer_dir(self.path)


def load_tokenizer_dir(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise EngineError(f"could not load a tokenizer from '{path}': {e}") from None
