"""RMSNorm, computed in float32 whatever the model dtype (as the checkpoints were trained); on
CUDA one fused Triton kernel, on a CPU one C loop (layers/activation.py says when)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.activation import cpu_ops, gpu_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            ops = gpu_ops()
            if ops is not None:
                return ops.rms_norm(x, self.weight, self.eps)
        elif x.device.type == "cpu":
            ops = cpu_ops()
            if ops is not None and ops.rows_ok(x, self.weight[None]):
                return ops.rms_norm(x, self.weight, self.eps)
        return self.eager(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
        """(this norm of ``residual + x``, ``residual + x``): on CUDA or a CPU one kernel."""
        if x.is_cuda and x.shape == residual.shape and x.stride(-1) == residual.stride(-1) == 1:
            ops = gpu_ops()
            if ops is not None:
                return ops.add_rms_norm(x, residual, self.weight, self.eps)
        elif x.device.type == "cpu" and x.shape == residual.shape:
            ops = cpu_ops()
            if ops is not None and ops.rows_ok(x, residual, self.weight[None]):
                return ops.add_rms_norm(x, residual, self.weight, self.eps)
        h = residual + x
        return self(h), h

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # the same ops without the two casts (a decode step's
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # the weight multiplies after the cast back, the order HF checkpoints expect
        return self.weight * x32.to(dtype)
