"""FP8 quantize / dequantize helpers.

Scales are float32 "dequantization" factors, as in vLLM and llm-compressor checkpoints:
``real ≈ fp8 * scale``. Weights get one scale per output row (per channel), activations one
per token (per row of x): the same row-wise rule, ``scale = max|row| / FP8_MAX``.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# the smallest scale: an all-zero row quantizes to zeros instead of 0/0 = NaN
MIN_SCALE = 1e-12
# widen_e4m3 returns the weight times this; callers fold its inverse into the scale
WIDEN_FACTOR = 2.0 ** -8


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (q [..., n] in ``dtype``, scale [..., 1] float32) with x ≈ q * scale.
    Every row's largest magnitude lands on the format's largest finite value."""
    x = x.float()
    fmax = torch.finfo(dtype).max
    scale = (x.abs().amax(dim=-1, keepdim=True) / fmax).clamp(min=MIN_SCALE)
    # the clamp only catches rounding at the edge; an explicit clamp keeps us off the
    # conversion's overflow behaviour (e5m2 overflows to inf)
    return (x / scale).clamp(-fmax, fmax).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    return (q.to(torch.float32) * scale).to(dtype)


def widen_e4m3(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * WIDEN_FACTOR`` in ``dtype``, exactly, for finite e4m3 ``q``.

    Why not ``q.to(dtype)``: on CPU torch converts float8 one element at a time (~10 ms for a
    2048x768 weight, several times the matmul it feeds). float16 has e4m3's layout with one more
    exponent bit and seven more mantissa bits, so moving e4m3's bits up by 7 gives a float16
    equal to q * 2**-8 (subnormals included), built from two vectorized integer ops.
    """
    bits = q.view(torch.int8).to(torch.int16)  # sign-extends: a negative byte becomes 0xFFxx
    # << 7 puts exponent+mantissa at bits 13..7 and the sign at bit 15; the & clears bit 14,
    # which the sign extension set for negative values
    bits = (bits << 7).bitwise_and_(-16385)  # -16385 == 0xBFFF as int16
    return bits.view(torch.float16).to(dtype)
