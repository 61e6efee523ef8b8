"""What weight-quantization plugins share: swapping the model's quantizable linears, and a linear
layer whose weight is stored quantized with one float32 scale per output row (per channel).

``RowQuantLinear`` does the packed-projection bookkeeping and the loading: a float checkpoint
weight is quantized as it arrives (``quantize_rows``), an already quantized one (in the
subclass's ``storage_dtype``) is kept with the checkpoint's ``weight_scale`` (per tensor, or
per channel [rows, 1]; for a packed module it comes per projection, and per-row scales keep
each one exact). A subclass sets ``storage_dtype`` and ``method`` (its name in messages),
implements ``quantize_rows`` and ``forward``, and may extend ``finish_loading`` (repack).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import EngineError


def swap_quantizable(model: nn.Module, make, ignored=frozenset()) -> nn.Module:
    """Replace every ``quantizable`` layer by ``make(layer, prefix)``, except those listed in
    ``ignored`` (checkpoint names; a packed projection is ignored only as a whole)."""
    for name, layer in list(model.named_modules()):
        if not getattr(layer, "quantizable", False):
            continue
        parent, _, attr = name.rpartition(".")
        prefix = parent if layer.shards else name
        names = [f"{parent}.{s}" if parent else s for s in layer.shards] \
            if layer.shards else [name]
        skipped = [n in ignored for n in names]
        if all(skipped):
            continue
        if any(skipped):
            raise EngineError(f"ignored_layers lists only part of the packed projections "
                              f"{', '.join(names)}; they run as one matmul here, so list "
                              f"all of them or none.")
        setattr(model.get_submodule(parent) if parent else model, attr, make(layer, prefix))
    return model


def scale_expected(stored: bool, scale: torch.Tensor | None, weight: str, scale_name: str,
                   storage: str) -> bool:
    """Whether a checkpoint scale ``scale_name`` is there to place: it must come exactly with a
    weight ``weight`` stored as ``storage`` (``stored``), not with one given in floats."""
    if not stored:
        if scale is not None:
            raise EngineError(f"The checkpoint has '{scale_name}' for a weight that is not "
                              f"{storage}.")
        return False
    if scale is None:
        raise EngineError(f"The checkpoint's '{weight}' is {storage} but it has no "
                          f"'{scale_name}'.")
    return True


class RowQuantLinear(nn.Module):
    storage_dtype: torch.dtype = torch.int8
    method = "quantized"
    scale_names: tuple[str, ...] = ("weight_scale",)  # what the checkpoint calls the scales

    def __init__(self, in_features: int, out_features: int, bias_dtype: torch.dtype | None,
                 shards: dict[str, int] | None = None, prefix: str = ""):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features,
                                               dtype=self.storage_dtype), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32),
                                         requires_grad=False)
        self.bias = None if bias_dtype is None else nn.Parameter(
            torch.empty(out_features, dtype=bias_dtype), requires_grad=False)
        self.shards = dict(shards) if shards else None
        self._offsets, start = {}, 0
        for name, rows in (self.shards or {}).items():
            self._offsets[name] = (start, rows)
            start += rows
        self.prefix = prefix  # the checkpoint name of the layer (of its parent, when packed)
        self._came_as: dict[str, str] = {}  # shard ("" unpacked) -> "stored" or "quantized"
        self._ckpt_scales: dict[str, torch.Tensor] = {}
        self._scale_names: dict[str, str] = {}  # shard -> the name its scale came under

    @property
    def storage_name(self) -> str:
        return str(self.storage_dtype).removeprefix("torch.")

    @classmethod
    def like(cls, layer: nn.Module, prefix: str):
        bias = layer.bias.dtype if layer.bias is not None else None
        return cls(layer.in_features, layer.out_features, bias, layer.shards, prefix)

    def quantize_rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A float weight [rows, in] -> (q in ``storage_dtype``, scale [rows, 1] float32)."""
        raise NotImplementedError

    # -- the packed-module interface the model and the loader use --------------------------
    @property
    def shard_names(self) -> list[str] | None:
        return list(self._offsets) if self.shards else None

    def shard_rows(self, shard: str) -> tuple[int, int]:
        return self._offsets[shard]

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(x).split(list(self.shards.values()), dim=-1)

    # -- loading ---------------------------------------------------------------------------------
    def checkpoint_tensors(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        required = ("weight", "bias") if self.bias is not None else ("weight",)
        return required, self.scale_names

    def _name(self, shard: str | None, local: str) -> str:
        return ".".join(p for p in (self.prefix, shard, local) if p)

    def load_tensor(self, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        start, rows = self.shard_rows(shard) if shard else (0, self.out_features)
        key = shard or ""
        if name == "weight":
            if tuple(tensor.shape) != (rows, self.in_features):
                raise EngineError(f"Tensor '{self._name(shard, name)}' has shape "
                                  f"{tuple(tensor.shape)} in the checkpoint but the model "
                                  f"expects {(rows, self.in_features)}.")
            if tensor.dtype == self.storage_dtype:
                self.weight[start: start + rows].copy_(tensor)
                self._came_as[key] = "stored"
            elif tensor.dtype.is_floating_point and tensor.element_size() > 1:
                self.store_quantized(start, rows, tensor.to(self.weight.device))
                self._came_as[key] = "quantized"
            else:
                raise EngineError(f"Tensor '{self._name(shard, name)}' is {tensor.dtype}; "
                                  f"{self.method} checkpoints store {self.storage_name} "
                                  f"weights.")
        elif name in self.scale_names:
            self._ckpt_scales[key] = tensor.float()
            self._scale_names[key] = name
        elif name == "bias":
            self.bias[start: start + rows].copy_(tensor)

    def store_quantized(self, start: int, rows: int, w: torch.Tensor) -> None:
        """A float weight's rows [start, start + rows), quantized here (``quantize_rows``)."""
        q, scale = self.quantize_rows(w)
        self.weight[start: start + rows].copy_(q)
        self.weight_scale[start: start + rows].copy_(scale)

    def finish_loading(self) -> None:
        """Put the checkpoint's scales in place, now that every tensor has arrived."""
        for shard, (start, rows) in (self._offsets or {"": (0, self.out_features)}).items():
            scale = self._ckpt_scales.pop(shard, None)
            name = self._name(shard or None, self._scale_names.pop(shard, self.scale_names[0]))
            if scale_expected(self._came_as.get(shard) != "quantized", scale,
                              self._name(shard or None, "weight"), name, self.storage_name):
                self.place_scale(name, start, rows, scale)
        self._came_as.clear()

    def place_scale(self, name: str, start: int, rows: int, scale: torch.Tensor) -> None:
        """The checkpoint's scale ``name`` of rows [start, start + rows), checked and stored:
        one per tensor or per output channel."""
        if scale.numel() not in (1, rows):
            raise EngineError(
                f"'{name}' has shape {tuple(scale.shape)}; expected one scale per tensor "
                f"or per output channel ({rows}). Block-wise scales are not supported.")
        self.weight_scale[start: start + rows].copy_(scale.reshape(-1, 1).expand(rows, 1))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, shards={self.shards}")
