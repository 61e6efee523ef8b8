"""HF directory -> model with weights: build on the meta device, materialize once in the target
dtype and device, then copy each safetensors tensor into place by name."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from engine.layers.linear import MergedLinear
from engine.registry import EngineError

INDEX_FILE = "model.safetensors.index.json"
# tensors some checkpoints carry that we recompute instead of loading
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str) -> list[str]:
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


def iter_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _target(name: str, packed: dict) -> tuple[str, str | None]:
    """Checkpoint name -> (our parameter name, shard of a MergedLinear or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            module, shard = packed[part]
            return ".".join([*parts[:i], module, *parts[i + 1:]]), shard
    return name, None


def _expected(model: nn.Module) -> set[str]:
    """Every checkpoint name the model needs (packed shards by their checkpoint names)."""
    names, done = set(), set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in done:
                continue  # a tied weight is loaded under its first name (the embedding)
            done.add(id(p))
            if isinstance(module, MergedLinear):
                parent = mod_name.rsplit(".", 1)[0]
                names.update(f"{parent}.{s}.{p_name}" for s in module.shard_names)
            else:
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


def load_weights(model: nn.Module, files: list[str]) -> None:
    packed = getattr(model, "packed_modules", {})
    params = dict(model.named_parameters())
    expected = _expected(model)
    seen = set()
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, tensor in iter_tensors(files):
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue  # a tied head is the embedding; some checkpoints store it anyway
        if name not in expected:
            raise EngineError(f"Unexpected tensor '{name}' in the checkpoint: the model has no "
                              f"such weight (wrong architecture in config.json?).")
        target, shard = _target(name, packed)
        param = params[target]
        if shard is not None:
            module = model.get_submodule(target.rsplit(".", 1)[0])
            start, rows = module.shard_rows(shard)
            param = param.narrow(0, start, rows)
        if tuple(param.shape) != tuple(tensor.shape):
            raise EngineError(f"Tensor '{name}' has shape {tuple(tensor.shape)} in the checkpoint "
                              f"but the model expects {tuple(param.shape)} "
                              f"(does config.json match the weights?).")
        param.copy_(tensor)  # converts to the model's dtype and device
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise EngineError(f"The checkpoint lacks {len(missing)} tensor(s) the model needs: "
                          f"{', '.join(missing[:5])}{more}.")


@torch.no_grad()
def load_model(model_cls, config, model_dir: str, dtype: torch.dtype, device="cpu") -> nn.Module:
    files = checkpoint_files(model_dir)
    with torch.device("meta"):
        model = model_cls(config)
    # dtype first (free on meta), then one allocation on the device, no init pass
    model = model.to(dtype=dtype).to_empty(device=device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty made separate tensors out of the shared one
    for module in model.modules():
        if module is not model and hasattr(module, "init_buffers"):
            module.init_buffers()
    load_weights(model, files)
    return model.eval()


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
