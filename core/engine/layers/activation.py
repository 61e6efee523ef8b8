"""SiLU-and-mul, and which kernels the small layers use (RMSNorm, SiLU-and-mul, rotary).

On CUDA with triton installed, each runs one fused Triton kernel (layers/fused_triton.py;
SGLang's and vLLM's fused ``rmsnorm``/``silu_and_mul``); on a CPU with float32 activations, one
C loop each (layers/cpu_fused.py: what an eager prompt chunk runs; a CPU graph's steps have
their own nodes). With ``ENGINE_NORM_KERNEL=torch``, and under torch.compile, the eager torch
ops, which give the same bits up to the order of RMSNorm's float32 sum (and the C loop's exp).
A machine where the kernels cannot load says so once in the log."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch
import torch.nn.functional as F

NORM_KERNEL_ENV = "ENGINE_NORM_KERNEL"  # "torch": the eager ops on a GPU too
log = logging.getLogger("engine")
_ops = None  # layers/fused_triton once imported; False where it cannot be


def gpu_ops():
    """layers/fused_triton, or None where the eager ops run (asked only for CUDA tensors)."""
    global _ops
    if os.environ.get(NORM_KERNEL_ENV, "auto") == "torch" or torch.compiler.is_compiling():
        return None  # (under torch.compile the compiler fuses the eager ops itself)
    if _ops is None:
        _ops = False
        if importlib.util.find_spec("triton") is None:
            log.warning("RMSNorm, SiLU-and-mul and the rotary embedding run as eager torch ops "
                        "on the GPU: triton is not installed (pip install triton) for their "
                        "fused kernels")
        else:
            try:
                import engine.layers.fused_triton as ops
                _ops = ops
            except Exception as exc:  # noqa: BLE001 (a broken triton install: said once)
                log.warning("RMSNorm, SiLU-and-mul and the rotary embedding run as eager torch "
                            "ops on the GPU: their Triton kernels did not import (%s: %s)",
                            type(exc).__name__, exc)
    return _ops or None


_cpu = None  # layers/cpu_fused once its library loaded; False where it cannot


def cpu_ops():
    """layers/cpu_fused, or None where the eager ops run (asked only for CPU tensors)."""
    global _cpu
    if os.environ.get(NORM_KERNEL_ENV, "auto") == "torch" or torch.compiler.is_compiling():
        return None
    if _cpu is None:
        _cpu = False
        try:
            import engine.layers.cpu_fused as ops
            ops.load()
            _cpu = ops
        except Exception as exc:  # noqa: BLE001 (no C compiler, a failed build: said once)
            log.warning("RMSNorm, SiLU-and-mul and the rotary embedding run as eager torch ops "
                        "on the CPU: their C loops did not load (%s: %s)",
                        type(exc).__name__, exc)
    return _cpu or None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: one kernel on a GPU or a CPU (rows with a contiguous last
    dimension; float32 on a CPU)."""
    if gate.is_cuda and gate.dim() == 2 and gate.stride(-1) == 1 and up.stride(-1) == 1:
        ops = gpu_ops()
        if ops is not None:
            return ops.silu_mul(gate, up)
    elif gate.device.type == "cpu" and gate.shape == up.shape:
        ops = cpu_ops()
        if ops is not None and ops.rows_ok(gate, up):
            return ops.silu_mul(gate, up)
    return F.silu(gate) * up
