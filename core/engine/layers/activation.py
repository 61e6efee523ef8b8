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
# where -> the kernels' module once loaded, or False where they cannot be (said once)
_loaded: dict[str, object] = {}


def _kernels(where: str, load):
    """The fused kernels for ``where`` ("GPU", "CPU"): ``load()``'s module, loaded once, or None
    where the eager ops run (ENGINE_NORM_KERNEL=torch, under torch.compile, or ``load`` raised:
    its reason is logged once)."""
    if os.environ.get(NORM_KERNEL_ENV, "auto") == "torch" or torch.compiler.is_compiling():
        return None  # (under torch.compile the compiler fuses the eager ops itself)
    if where not in _loaded:
        _loaded[where] = False
        try:
            _loaded[where] = load()
        except Exception as exc:  # noqa: BLE001 (no triton or C compiler, a failed build)
            log.warning("RMSNorm, SiLU-and-mul and the rotary embedding run as eager torch ops "
                        "on the %s: %s", where, exc)
    return _loaded[where] or None


def _load_triton():
    if importlib.util.find_spec("triton") is None:
        raise ImportError("triton is not installed (pip install triton) for their fused kernels")
    try:
        import engine.layers.fused_triton as ops
    except Exception as exc:  # a broken triton install
        raise ImportError(f"their Triton kernels did not import ({type(exc).__name__}: "
                          f"{exc})") from exc
    return ops


def _load_c():
    try:
        import engine.layers.cpu_fused as ops

        ops.load()
    except Exception as exc:  # no C compiler, a failed build
        raise ImportError(f"their C loops did not load ({type(exc).__name__}: {exc})") from exc
    return ops


def gpu_ops():
    """layers/fused_triton, or None where the eager ops run (asked only for CUDA tensors)."""
    return _kernels("GPU", _load_triton)


def cpu_ops():
    """layers/cpu_fused, or None where the eager ops run (asked only for CPU tensors)."""
    return _kernels("CPU", _load_c)


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
