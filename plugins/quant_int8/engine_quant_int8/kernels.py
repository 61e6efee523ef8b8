"""The int8 GEMMs behind Int8Linear, with per-token activation scales, and which of them runs
on a device (``kernel_for``: the method picks it, the layer quantizes its weights for it).

All of them compute ``y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] * q_w[n, k]``: symmetric int8
weights with one scale per output row, activations quantized per token (row of x).

- ``fbgemm`` (CPU): ``torch.ops.quantized.linear_dynamic`` on weights prepacked once. It
  quantizes its input per tensor (uint8, from the tensor's min and max), so each token is first
  divided by its own largest magnitude and one fixed row [+1, -1, 0, ...] is appended: the
  tensor's range is then always exactly [-1, 1], every token gets the same 8-bit grid relative
  to its own maximum (per-token quantization), and a token's result does not depend on the
  other tokens of the batch. The output is multiplied back by each token's maximum. AVX2's
  16-bit multiply-add pairs would saturate with full-range weights, so weights quantized here
  use [-64, 64]; a checkpoint's full-range int8 weights run with fbgemm's ``reduce_range``
  (7-bit activations) instead. Measured on SmolLM2 (benchmarks/weight_quality.py), 8-bit
  activations with [-64, 64] weights lose less than 7-bit activations with [-127, 127] weights.
- ``int_mm`` (CUDA; also runs on CPU, slowly, which is how it is tested here):
  ``torch._int_mm`` of int8 activations (``round(x / s_x)``, ``s_x = max|row| / 127``) with the
  int8 weight, int32 accumulators scaled by ``s_x * s_w``. CUDA's int8 GEMM wants more than 16
  rows, so smaller batches are padded with zero rows.
"""

from __future__ import annotations

import os
import warnings

import torch

from engine.layers.linear import fbgemm_available
from engine.registry import EngineError

MIN_SCALE = 1e-12  # an all-zero token quantizes to zeros instead of 0 / 0
FENCE = torch.tensor([1.0, -1.0])
INT_MM_MIN_ROWS = 17
# AVX2 multiplies uint8 activations by int8 weights in pairs summed into int16
# (vpmaddubsw), which saturates above 32767: 2 * 255 * 64 = 32640 cannot, 2 * 255 * 127 can.
FBGEMM_WEIGHT_QMAX = 64
KERNEL_LOG = {
    "fbgemm": "fbgemm int8 GEMM (torch.ops.quantized.linear_dynamic), weights prepacked at "
              "load, activations int8 per token",
    "int_mm": "torch._int_mm int8 GEMM, activations int8 per token",
}
KERNEL_ENV = "ENGINE_INT8_KERNEL"  # force "fbgemm" or "int_mm" (comparisons, tests)


def kernel_for(device: torch.device) -> str | None:
    """The kernel Int8Linear runs on ``device`` (KERNEL_ENV forces one), None where none runs."""
    forced = os.environ.get(KERNEL_ENV)
    if forced:
        if forced not in KERNEL_LOG:
            raise EngineError(f"{KERNEL_ENV}={forced!r}: use one of {', '.join(KERNEL_LOG)}.")
        return forced
    if device.type == "cpu":
        return "fbgemm" if fbgemm_available() else None
    if device.type == "cuda":
        return "int_mm"
    return None


def quantize_rows(x: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] float -> (int8 [..., n] in [-qmax, qmax], float32 scale [..., 1]),
    x ≈ q * scale, symmetric."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=MIN_SCALE)
    return (x / scale).round().clamp(-qmax, qmax).to(torch.int8), scale


def fbgemm_pack(weight: torch.Tensor, scale: torch.Tensor):
    """int8 weight [N, K] + float32 scale [N, 1] -> fbgemm's packed weight (no bias: the bias is
    added after the per-token rescale)."""
    with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm still takes them
        warnings.simplefilter("ignore")
        q = torch._make_per_channel_quantized_tensor(
            weight.cpu(), scale.reshape(-1).double().cpu(),
            torch.zeros(weight.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(q, None)


def fbgemm_linear(x: torch.Tensor, packed, reduce_range: bool) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32. ``reduce_range``: 7-bit activations, for weights
    beyond +-FBGEMM_WEIGHT_QMAX."""
    m, k = x.shape
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).clamp_(min=MIN_SCALE)
    rows = torch.empty(m + 1, k, dtype=torch.float32)
    torch.div(x, amax, out=rows[:m])
    rows[m].zero_()
    rows[m, :2] = FENCE  # the range of every call is exactly [-1, 1]
    y = torch.ops.quantized.linear_dynamic(rows, packed, reduce_range)
    return y[:m].mul_(amax)


def int_mm_linear(x: torch.Tensor, weight_t: torch.Tensor, scale_row: torch.Tensor
                  ) -> torch.Tensor:
    """x [M, K] float; weight_t [K, N] int8 (the weight transposed); scale_row [1, N] float32."""
    m = x.shape[0]
    xq, sx = quantize_rows(x)
    if m < INT_MM_MIN_ROWS:
        xq = torch.cat([xq, xq.new_zeros(INT_MM_MIN_ROWS - m, xq.shape[1])])
    acc = torch._int_mm(xq, weight_t)[:m]
    return acc.float() * sx * scale_row
