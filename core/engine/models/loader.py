"""Checkpoint (an HF directory or a GGUF file, see checkpoint.py) -> model with weights: build on
the meta device (where a quantization method swaps its layers in), materialize once in the target
dtype and device, then hand each checkpoint tensor to its module by its HF name.

By default a tensor is copied into the parameter of that name. A module may take its tensors over
(a quantized linear quantizes a bf16 weight as it arrives, keeps an fp8 one with its scale): it
defines ``checkpoint_tensors() -> (required, optional)``, the local names it accepts, and
``load_tensor(name, tensor, shard)``. A packed module (``shard_names``, ``shard_rows(shard)``; see
layers/linear.py) gets its projections' tensors with ``shard`` set to the projection's name.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.checkpoint import Checkpoint
from engine.registry import EngineError

# tensors some checkpoints carry that we recompute instead of loading
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _accepted(module: nn.Module, done: set) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) checkpoint names local to ``module``."""
    if hasattr(module, "load_tensor"):
        return module.checkpoint_tensors()
    required = []
    for p_name, p in module.named_parameters(recurse=False):
        if id(p) not in done:  # a tied weight is loaded under its first name (the embedding)
            done.add(id(p))
            required.append(p_name)
    return tuple(required), ()


def checkpoint_index(model: nn.Module) -> dict[str, tuple[nn.Module, str, str | None, bool]]:
    """Every checkpoint name the model accepts -> (module, local name, shard, required).
    A packed module's tensors are named after its shards (q_proj, ...), siblings of the module."""
    index, done = {}, set()
    for mod_name, module in model.named_modules():
        required, optional = _accepted(module, done)
        shards = getattr(module, "shard_names", None)
        if shards:
            parent = mod_name.rpartition(".")[0]
            owners = [(f"{parent}.{s}" if parent else s, s) for s in shards]
        else:
            owners = [(mod_name, None)]
        for owner, shard in owners:
            for names, need in ((required, True), (optional, False)):
                for local in names:
                    index[f"{owner}.{local}" if owner else local] = (module, local, shard, need)
    return index


def _copy(module: nn.Module, local: str, shard: str | None, tensor: torch.Tensor,
          name: str, ckpt: Checkpoint) -> None:
    param = getattr(module, local)
    if shard is not None:
        start, rows = module.shard_rows(shard)
        param = param.narrow(0, start, rows)
    if tuple(param.shape) != tuple(tensor.shape):
        raise EngineError(f"Tensor {ckpt.label(name)} has shape {tuple(tensor.shape)} in the "
                          f"checkpoint but the model expects {tuple(param.shape)} "
                          f"({ckpt.mismatch_hint}).")
    param.copy_(tensor)  # converts to the model's dtype and device


def load_weights(model: nn.Module, ckpt: Checkpoint, dtype: torch.dtype) -> None:
    index = checkpoint_index(model)
    seen = set()
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, tensor in ckpt.tensors(dtype):
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue  # a tied head is the embedding; some checkpoints store it anyway
        if name not in index:
            raise EngineError(f"Unexpected tensor {ckpt.label(name)} in the checkpoint: the "
                              f"model has no such weight (wrong architecture in "
                              f"{ckpt.config_source}?).")
        module, local, shard, _ = index[name]
        if hasattr(module, "load_tensor"):
            module.load_tensor(local, tensor, shard)
        else:
            _copy(module, local, shard, tensor, name, ckpt)
        seen.add(name)
    missing = sorted(n for n, (*_, required) in index.items() if required and n not in seen)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise EngineError(f"The checkpoint {ckpt.path} lacks {len(missing)} tensor(s) the model "
                          f"needs: {', '.join(missing[:5])}{more}.")


@torch.no_grad()
def load_model(model_cls, config, ckpt: Checkpoint, dtype: torch.dtype, device="cpu",
               quant_method=None) -> nn.Module:
    with torch.device("meta"):
        # dtype first (free on meta), then one allocation on the device, no init pass
        model = model_cls(config).to(dtype=dtype)
        if quant_method is not None:
            # after the cast, which would widen the swapped-in quantized tensors too
            model = quant_method.convert(model)
    model = model.to_empty(device=device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty made separate tensors out of the shared one
    for module in model.modules():
        if module is not model and hasattr(module, "init_buffers"):
            module.init_buffers()
    load_weights(model, ckpt, dtype)
    if quant_method is not None:
        for module in model.modules():
            quant_method.process_weights(module)
    return model.eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as stored: quantized tensors count as such, packed ones too (a
    packed copy of a tied head included; fbgemm's float16 packs are objects, not tensors)."""
    packed = [b for b in model.buffers() if b.is_mkldnn]  # never parameters: prepack swaps them
    opaque = sum(getattr(m, "opaque_bytes", 0) for m in model.modules())
    return opaque + sum(t.numel() * t.element_size() for t in [*model.parameters(), *packed])
