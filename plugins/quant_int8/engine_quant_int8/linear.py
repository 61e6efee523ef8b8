"""Int8Linear: int8 weight [out, in] with one float32 scale per output row; the forward runs an
int8 GEMM with per-token activation scales (kernels.py). Loading (a float weight quantized as it
arrives, an int8 one kept with the checkpoint's ``weight_scale``) is the core's RowQuantLinear."""

from __future__ import annotations

import torch

from engine.layers.quantized import RowQuantLinear
from engine_quant_int8 import kernels


class Int8Linear(RowQuantLinear):
    storage_dtype = torch.int8
    method = "w8a8_int8"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernel = None  # "fbgemm" or "int_mm"; set by prepare()
        self._packed = None
        self.reduce_range = False  # fbgemm: 7-bit activations (full-range checkpoint weights)

    def quantize_rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qmax = kernels.FBGEMM_WEIGHT_QMAX if kernels.kernel_for(w.device) == "fbgemm" else 127
        return kernels.quantize_rows(w, qmax)

    def prepare(self, kernel: str) -> None:
        """Pack the weight for ``kernel``, once, after loading."""
        self.finish_loading()
        self.kernel = kernel
        if kernel == "fbgemm":
            self.reduce_range = bool(self.weight.abs().max() > kernels.FBGEMM_WEIGHT_QMAX)
            self._packed = kernels.fbgemm_pack(self.weight, self.weight_scale)
        elif kernel == "int_mm":
            self.register_buffer("weight_t", self.weight.t(), persistent=False)
            self.register_buffer("scale_row", self.weight_scale.reshape(1, -1).contiguous(),
                                 persistent=False)
        else:
            raise ValueError(f"unknown int8 kernel {kernel!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "fbgemm":
            y = kernels.fbgemm_linear(x2.float(), self._packed, self.reduce_range)
        else:
            y = kernels.int_mm_linear(x2, self.weight_t, self.scale_row)
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel={self.kernel}"
