"""FP8Linear: a linear layer whose weight stays float8_e4m3fn, one float32 scale per output row.

Forward, two paths:
- dequantize (CPU, older GPUs, odd shapes): widen the weight of this one layer to the
  activation dtype, matmul, scale the output columns (a per-row weight scale is a per-column
  output scale, so the [out, in] weight is never multiplied);
- ``torch._scaled_mm`` (CUDA, compute capability >= 8.9): activations quantized per token on the
  fly, FP8 x FP8 on the tensor cores with row-wise scales.

Checkpoint tensors arrive through ``load_tensor``: a bf16/fp32 weight is quantized as it comes;
an e4m3 weight is kept with the checkpoint's ``weight_scale`` (per tensor, or per channel
[rows, 1]), which for a packed module comes per projection: per-row scales keep each one exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.registry import EngineError
from engine_quant_fp8.quant import E4M3, WIDEN_FACTOR, quantize_rows, widen_e4m3


class FP8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias_dtype: torch.dtype | None,
                 shards: dict[str, int] | None = None, prefix: str = ""):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=E4M3),
                                   requires_grad=False)
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
        self.fast = False  # torch._scaled_mm; decided by FP8Method.process_weights
        self._came_as: dict[str, str] = {}  # shard ("" unpacked) -> "fp8" or "quantized"
        self._ckpt_scales: dict[str, torch.Tensor] = {}

    @classmethod
    def like(cls, layer: nn.Module, prefix: str) -> "FP8Linear":
        bias = layer.bias.dtype if layer.bias is not None else None
        return cls(layer.in_features, layer.out_features, bias, layer.shards, prefix)

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
        # input_scale (a static activation scale) is accepted and unused: activations are
        # quantized per token on the fast path and not at all on the dequantize path
        return required, ("weight_scale", "input_scale")

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
            if tensor.dtype == E4M3:
                self.weight[start: start + rows].copy_(tensor)
                self._came_as[key] = "fp8"
            elif tensor.dtype.is_floating_point and tensor.element_size() > 1:
                q, scale = quantize_rows(tensor.to(self.weight.device))
                self.weight[start: start + rows].copy_(q)
                self.weight_scale[start: start + rows].copy_(scale)
                self._came_as[key] = "quantized"
            else:
                raise EngineError(f"Tensor '{self._name(shard, name)}' is {tensor.dtype}; FP8 "
                                  f"checkpoints store float8_e4m3fn weights.")
        elif name == "weight_scale":
            self._ckpt_scales[key] = tensor.float()
        elif name == "bias":
            self.bias[start: start + rows].copy_(tensor)

    def finish_loading(self) -> None:
        """Put the checkpoint's scales in place, now that every tensor has arrived."""
        for shard, (start, rows) in (self._offsets or {"": (0, self.out_features)}).items():
            scale = self._ckpt_scales.pop(shard, None)
            name = self._name(shard or None, "weight_scale")
            if self._came_as.get(shard) == "quantized":
                if scale is not None:
                    raise EngineError(f"The checkpoint has '{name}' for a weight that is not "
                                      f"float8_e4m3fn.")
                continue
            if scale is None:
                raise EngineError(f"The checkpoint's '{self._name(shard or None, 'weight')}' "
                                  f"is float8_e4m3fn but it has no '{name}'.")
            if scale.numel() not in (1, rows):
                raise EngineError(
                    f"'{name}' has shape {tuple(scale.shape)}; expected one scale per tensor "
                    f"or per output channel ({rows}). Block-wise FP8 is not supported.")
            self.weight_scale[start: start + rows].copy_(scale.reshape(-1, 1).expand(rows, 1))
        self._came_as.clear()
        # the dequantize path scales output columns; WIDEN_FACTOR is folded in here
        self.register_buffer("out_scale", self.weight_scale.reshape(1, -1) / WIDEN_FACTOR,
                             persistent=False)
        self.register_buffer("scale_b", self.weight_scale.reshape(1, -1).contiguous(),
                             persistent=False)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast:
            y = self._scaled_mm(x)
        else:
            y = F.linear(x, widen_e4m3(self.weight, x.dtype)) * self.out_scale.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, x_scale = quantize_rows(x.reshape(-1, self.in_features))  # per token
        # row-wise scaled FP8 GEMM: mat2 must be column-major, which weight.t() is; row-wise
        # scales need a bfloat16 output
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale_b,
                             out_dtype=torch.bfloat16)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, shards={self.shards}, fast={self.fast}")
