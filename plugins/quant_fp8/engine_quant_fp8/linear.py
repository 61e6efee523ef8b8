"""FP8Linear: a linear layer whose weight stays float8_e4m3fn, one float32 scale per output row.

Forward, two paths:
- dequantize (CPU, older GPUs, odd shapes): widen the weight of this one layer to the
  activation dtype, matmul, scale the output columns (a per-row weight scale is a per-column
  output scale, so the [out, in] weight is never multiplied);
- ``torch._scaled_mm`` (CUDA, compute capability >= 8.9): activations quantized per token on the
  fly, FP8 x FP8 on the tensor cores with row-wise scales.

Loading (a bf16/fp32 weight quantized as it comes, an e4m3 one kept with the checkpoint's
``weight_scale``) and the packed-projection bookkeeping are the core's RowQuantLinear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.quantized import RowQuantLinear
from engine_quant_fp8.quant import E4M3, WIDEN_FACTOR, quantize_rows, widen_e4m3


class FP8Linear(RowQuantLinear):
    storage_dtype = E4M3
    method = "FP8"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast = False  # torch._scaled_mm; decided by FP8Method.process_weights

    def quantize_rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows(w)

    def checkpoint_tensors(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        required, optional = super().checkpoint_tensors()
        # input_scale (a static activation scale) is accepted and unused: activations are
        # quantized per token on the fast path and not at all on the dequantize path
        return required, (*optional, "input_scale")

    def finish_loading(self) -> None:
        super().finish_loading()
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
        return f"{super().extra_repr()}, fast={self.fast}"
