"""Checkpoint (an HF directory or a GGUF file, see checkpoint/) -> model with weights: build on
the meta device (where a quantization method swaps its layers in), materialize once in the target
dtype and device, then hand each checkpoint tensor to its module by its HF name.

By default a tensor is copied into the parameter of that name. A module may take its tensors over
(a quantized linear quantizes a bf16 weight as it arrives, keeps an fp8 one with its scale): it
defines ``checkpoint_tensors() -> (required, optional)``, the local names it accepts, and
``load_tensor(name, tensor, shard)``. A packed module (``shard_names``, ``shard_rows(shard)``; see
layers/linear.py) gets its projections' tensors with ``shard`` set to the projection's name.

With a tensor-parallel group (``tp``) the model is built sharded (engine.parallel.layers) and a
module that is cut says how (``tp_cut(local, shard)``): the loader keeps only the rank's chunk.
From safetensors it reads only that chunk (``get_slice``); a GGUF's tensors arrive whole
(dequantized one at a time) and are cut before they are copied, so a rank holds its shard only.

With a pipeline stage (``pp``) the model holds only the stage's part; a checkpoint tensor that
the model calls another stage's (``other_stage_tensor(name)``) is skipped by name, before it is
read (or, from a GGUF, dequantized); with a tp group a model's ``other_rank_tensor(name)``
says it in place of ``other_stage_tensor`` (also true for the experts another expert-parallel
rank holds: engine.parallel.experts). A model may load a checkpoint tensor under another of its
names (``checkpoint_aliases()``: a tied head on a last stage reads the embedding's tensor).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import EngineError
from engine.models.checkpoint import Checkpoint

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


def _tp_cut(module: nn.Module, local: str, shard: str | None):
    return module.tp_cut(local, shard) if hasattr(module, "tp_cut") else None


def _copy(module: nn.Module, local: str, shard: str | None, tensor: torch.Tensor,
          name: str, ckpt: Checkpoint, cut=None, full_shape=None) -> None:
    """Copy ``tensor`` into the parameter; with a tp ``cut`` it is the rank's chunk of a
    checkpoint tensor of ``full_shape``, which must cut into the parameter's shape (the last
    vocab chunk may be short: the parameter's padding rows stay zero)."""
    param = getattr(module, local)
    if shard is not None:
        start, rows = module.shard_rows(shard)
        param = param.narrow(0, start, rows)
    got = tuple(tensor.shape if cut is None else full_shape)
    if cut is not None and param.shape[cut.dim] == cut.size(full_shape[cut.dim]):
        param = param.narrow(cut.dim, 0, tensor.shape[cut.dim])
        got = tuple(tensor.shape)
    if tuple(param.shape) != got:
        what = "" if cut is None else f", cut for tp rank {cut.index} of {cut.parts}"
        raise EngineError(f"Tensor {ckpt.label(name)} has shape {tuple(full_shape or got)} in "
                          f"the checkpoint but the model expects {tuple(param.shape)}{what} "
                          f"({ckpt.mismatch_hint}).")
    param.copy_(tensor)  # converts to the model's dtype and device


def _read_cut(sl, cut) -> torch.Tensor:
    """The rank's chunk of a safetensors slice, read alone."""
    start, length = cut.bounds(sl.get_shape()[cut.dim])
    index = [slice(None)] * cut.dim + [slice(start, start + length)]
    return sl[tuple(index)]


def _read(ckpt: Checkpoint, dtype: torch.dtype, keep):
    return ckpt.tensors(dtype) if keep is None else ckpt.tensors(dtype, keep)


def _tensors(ckpt: Checkpoint, dtype: torch.dtype, index: dict, tp, keep=None):
    """(name, tensor as read, its cut or None, its full shape) for every checkpoint tensor
    (``keep``: only those whose name it accepts, the others never read); with ``tp`` a tensor
    that is cut comes as the rank's chunk (read alone from safetensors)."""
    if tp is None:
        for name, tensor in _read(ckpt, dtype, keep):
            yield name, tensor, None, tuple(tensor.shape)
        return
    if ckpt.format == "hf":
        from safetensors import safe_open

        from engine.models.checkpoint import safetensors_files

        for path in safetensors_files(ckpt.path):
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if keep is not None and not keep(name):
                        continue
                    cut = _tp_cut(*index[name][:3]) if name in index else None
                    if cut is None:
                        yield name, f.get_tensor(name), None, None
                    else:
                        sl = f.get_slice(name)
                        yield name, _read_cut(sl, cut), cut, tuple(sl.get_shape())
        return
    for name, tensor in _read(ckpt, dtype, keep):  # a GGUF: whole tensors, cut here
        cut = _tp_cut(*index[name][:3]) if name in index else None
        yield name, tensor if cut is None else cut.apply(tensor), cut, tuple(tensor.shape)


def load_weights(model: nn.Module, ckpt: Checkpoint, dtype: torch.dtype, tp=None,
                 pp=None) -> None:
    index = checkpoint_index(model)
    if hasattr(model, "checkpoint_aliases"):
        for ckpt_name, model_name in model.checkpoint_aliases().items():
            index[ckpt_name] = index.pop(model_name)
    tied = getattr(model.config, "tie_word_embeddings", False)

    def ignored(name: str) -> bool:  # a tied head is the embedding; some checkpoints store it
        return name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")

    keep = None
    # another rank's tensor: another stage's layers, another expert-parallel rank's experts
    elsewhere = getattr(model, "other_rank_tensor", None) if tp is not None else None
    if elsewhere is None and pp is not None:
        elsewhere = model.other_stage_tensor
    if elsewhere is not None:
        def keep(name: str) -> bool:
            return name in index or not (ignored(name) or elsewhere(name))
    seen = set()
    for name, tensor, cut, full_shape in _tensors(ckpt, dtype, index, tp, keep):
        if ignored(name):
            continue
        if name not in index:
            raise EngineError(f"Unexpected tensor {ckpt.label(name)} in the checkpoint: the "
                              f"model has no such weight (wrong architecture in "
                              f"{ckpt.config_source}?).")
        module, local, shard, _ = index[name]
        if hasattr(module, "load_tensor"):
            module.load_tensor(local, tensor, shard)
        else:
            _copy(module, local, shard, tensor, name, ckpt, cut, full_shape)
        seen.add(name)
    missing = sorted(n for n, (*_, required) in index.items() if required and n not in seen)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise EngineError(f"The checkpoint {ckpt.path} lacks {len(missing)} tensor(s) the model "
                          f"needs: {', '.join(missing[:5])}{more}.")


@torch.no_grad()
def load_model(model_cls, config, ckpt: Checkpoint, dtype: torch.dtype, device="cpu",
               quant_method=None, tp=None, pp=None) -> nn.Module:
    """``tp``: this rank's TPGroup (engine.parallel.group); the model holds only its shard.
    ``pp``: this rank's PPStage (engine.parallel.stage); the model holds only the stage's part
    and only its tensors are read."""
    if tp is not None and quant_method is not None:
        raise EngineError("tensor parallelism does not support quantized models yet; serve "
                          "without --quantization or with --tp-size 1.")
    if pp is not None and not getattr(model_cls, "supports_pp", False):
        arch = getattr(config, "architecture", model_cls.__name__)
        raise EngineError(f"architecture {arch} does not support --pp-size yet; serve it with "
                          f"--pp-size 1.")
    parallel = {k: v for k, v in (("tp", tp), ("pp", pp)) if v is not None}
    with torch.device("meta"):
        # dtype first (free on meta), then one allocation on the device, no init pass
        model = model_cls(config, **parallel).to(dtype=dtype)
        if quant_method is not None:
            # after the cast, which would widen the swapped-in quantized tensors too
            model = quant_method.convert(model)
    model = model.to_empty(device=device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty made separate tensors out of the shared one
    for module in model.modules():
        if module is not model and hasattr(module, "init_buffers"):
            module.init_buffers()
    load_weights(model, ckpt, dtype, tp, pp)
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
