"""The FP8 KV-cache formats fp8_e4m3 and fp8_e5m2, behind the core's KVDtype interface.

Storing is the interface's scaled rule (value / per-layer scale, clamped to the format's
finite range: a cast past it gives NaN in e4m3fn, inf in e5m2), which is also what the fused
attention kernels assume when they read the pool's buffers with the scales. Loading e4m3 on CPU
widens the bytes with integer ops (quant.widen_e4m3), about 2x faster than torch's float8 cast
there and equal to it; elsewhere, and for e5m2 (whose cast is already fast on CPU), it is the
interface's cast times the scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.interfaces import KVDtype
from engine_quant_fp8.quant import E4M3, E5M2, WIDEN_FACTOR, widen_e4m3


@dataclass(frozen=True)
class FP8KVDtype(KVDtype):
    needs_scale: bool = True

    def __post_init__(self):
        assert self.storage in (E4M3, E5M2) and self.needs_scale, self

    def load(self, stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        if self.storage != E4M3 or stored.device.type != "cpu":
            return super().load(stored, scale, dtype)
        # widen_e4m3 gives q * WIDEN_FACTOR: its inverse is folded into the scale
        return widen_e4m3(stored, dtype) * (scale / WIDEN_FACTOR)
