"""FP8Linear: a linear layer whose weight stays float8_e4m3fn, one float32 scale per output row.

Forward, two paths:
- dequantize (CPU, older GPUs, odd shapes): widen the weight of this one layer to the
  activation dtype, matmul, scale the output columns (a per-row weight scale is a per-column
  output scale, so the [out, in] weight is never multiplied);
- ``torch._scaled_mm`` (CUDA, compute capability >= 8.9): activations quantized per token on the
  fly, FP8 x FP8 on the tensor cores with row-wise scales.

Activations: a checkpoint with ``activation_scheme: "static"`` gives every layer a fixed
``input_scale`` (vLLM's static scheme): both paths then round the activations to e4m3 with that
scale (``x ≈ q * input_scale``, clamped to ±448), the fast path feeding q to the FP8 GEMM, the
dequantize path widening q exactly, so that both compute what the checkpoint was calibrated for.
Without it the fast path quantizes per token and the dequantize path not at all (W8A16).

Loading (a bf16/fp32 weight quantized as it comes, an e4m3 one kept with the checkpoint's
``weight_scale``) and the packed-projection bookkeeping are the core's RowQuantLinear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.quantized import RowQuantLinear
from engine.registry import EngineError
from engine_quant_fp8.quant import E4M3, WIDEN_FACTOR, quantize_rows, widen_e4m3

FP8_MAX = torch.finfo(E4M3).max


class FP8Linear(RowQuantLinear):
    storage_dtype = E4M3
    method = "FP8"

    def __init__(self, *args, static_input: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast = False  # torch._scaled_mm; decided by FP8Method.process_weights
        # activation_scheme "static": the checkpoint must give every projection an input_scale
        self.static_input = static_input
        self._input_scales: dict[str, torch.Tensor] = {}  # shard ("" unpacked) -> checkpoint's
        # the one scale this layer uses (set by finish_loading), or None: dynamic
        self.register_buffer("input_scale", None, persistent=False)

    @classmethod
    def like(cls, layer, prefix: str, static_input: bool = False):
        bias = layer.bias.dtype if layer.bias is not None else None
        return cls(layer.in_features, layer.out_features, bias, layer.shards, prefix,
                   static_input=static_input)

    def quantize_rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows(w)

    def checkpoint_tensors(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        required, optional = super().checkpoint_tensors()
        if self.static_input:
            return (*required, "input_scale"), optional
        # optional here only to refuse it with a clear message in finish_loading
        return required, (*optional, "input_scale")

    def load_tensor(self, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        if name == "input_scale":
            self._input_scales[shard or ""] = tensor.float()
        else:
            super().load_tensor(name, tensor, shard)

    def finish_loading(self) -> None:
        super().finish_loading()
        scales, self._input_scales = self._input_scales, {}
        if scales and not self.static_input:
            raise EngineError(
                f"The checkpoint has '{self._name(next(iter(scales)) or None, 'input_scale')}' "
                f"(a static activation scale) but its quantization_config does not say "
                f"activation_scheme \"static\"; set it to \"static\" to use the scales, or "
                f"drop the input_scale tensors for dynamic activations.")
        for shard, scale in scales.items():
            name = self._name(shard or None, "input_scale")
            if scale.numel() != 1:
                raise EngineError(f"'{name}' has shape {tuple(scale.shape)}; engine-quant-fp8 "
                                  f"supports one static activation scale per tensor only.")
            if not (torch.isfinite(scale).all() and (scale > 0).all()):
                raise EngineError(f"'{name}' is {scale.item()}; an activation scale must be "
                                  f"positive and finite.")
        out_scale = self.weight_scale.reshape(1, -1) / WIDEN_FACTOR
        if scales:
            # q/k/v (gate/up) read the same x, so one scale serves the packed matmul: the
            # largest, which clips none of them (vLLM does the same)
            scale = torch.stack([s.reshape(()) for s in scales.values()]).max()
            self.register_buffer("input_scale", scale.to(self.weight.device), persistent=False)
            out_scale = out_scale * (scale.item() / WIDEN_FACTOR)  # the widened activations'
        # the dequantize path scales output columns; WIDEN_FACTOR is folded in here
        self.register_buffer("out_scale", out_scale, persistent=False)
        self.register_buffer("scale_b", self.weight_scale.reshape(1, -1).contiguous(),
                             persistent=False)

    # -- forward -------------------------------------------------------------------------------
    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> e4m3 q with x ≈ q * input_scale (the static scheme)."""
        return (x.float() / self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast:
            y = self._scaled_mm(x)
        else:
            if self.input_scale is not None:  # exactly q * 2**-8; out_scale has the rest
                x = widen_e4m3(self.quantize_input(x), x.dtype)
            y = F.linear(x, widen_e4m3(self.weight, x.dtype)) * self.out_scale.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.input_scale is None:
            xq, x_scale = quantize_rows(x)  # per token
        else:  # row-wise scales must come as [tokens, 1], contiguous
            xq, x_scale = self.quantize_input(x), self.input_scale.expand(x.shape[0], 1)
            x_scale = x_scale.contiguous()
        # row-wise scaled FP8 GEMM: mat2 must be column-major, which weight.t() is; row-wise
        # scales need a bfloat16 output
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale_b,
                             out_dtype=torch.bfloat16)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        static = "" if self.input_scale is None else f", input_scale={self.input_scale.item():g}"
        return f"{super().extra_repr()}, fast={self.fast}{static}"
