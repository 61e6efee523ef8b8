"""RMSNorm (with the residual add), SiLU-and-mul and the rotary embedding as one C loop each on a
CPU (cpu_fused.c), for eager forwards of many tokens (prompt chunks the CPU graph does not
replay): each is one pass over the rows instead of 3-5 torch ops. Built once per machine like
the CPU graph's library (``engine.native.build_library``, ``-march=native``); float32 only.

layers/activation.py's ``cpu_ops()`` says when they run; the callers check the layouts below.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch  # loaded first, so the library's OpenMP dependency resolves to torch's own runtime

from engine.cpu_graph.native import include_dir, math_key
from engine.native import build_library, cpu_flags

SOURCE = Path(__file__).with_name("cpu_fused.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
         "-ffp-contract=off"]


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    """The loaded library; raises engine.native.BuildError with the reason."""
    lib = ctypes.CDLL(str(build_library(SOURCE, [*FLAGS, "-I", include_dir()],
                                        "the fused CPU layers",
                                        key_extra=cpu_flags() + math_key())))
    P, I64, INT, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.ek_rms_norm.argtypes = [P, I64, P, I64, P, I64, P, I64, I64, F, P, I64, INT]
    lib.ek_silu_mul.argtypes = [P, I64, P, I64, P, I64, I64, I64, INT]
    lib.ek_rotary.argtypes = [P, I64, I64, I64, P, P, P, I64, INT]
    for fn in (lib.ek_rms_norm, lib.ek_silu_mul, lib.ek_rotary):
        fn.restype = None
    return lib


def rows_ok(*xs: torch.Tensor) -> bool:
    """2-D float32 CPU tensors whose rows are contiguous (row strides may differ)."""
    return all(x.dim() == 2 and x.dtype == torch.float32 and x.stride(-1) == 1 for x in xs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` of each row of x [T, dim] (rows_ok)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    load().ek_rms_norm(x.data_ptr(), x.stride(0), None, 0, None, 0, weight.data_ptr(),
                       x.shape[0], x.shape[1], eps, out.data_ptr(), x.shape[1],
                       torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm of ``residual + x``, ``residual + x``), one pass (rows_ok, same shapes)."""
    h = torch.empty(x.shape, dtype=torch.float32)
    out = torch.empty(x.shape, dtype=torch.float32)
    load().ek_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                       h.data_ptr(), x.shape[1], weight.data_ptr(), x.shape[0], x.shape[1], eps,
                       out.data_ptr(), x.shape[1], torch.get_num_threads())
    return out, h


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of rows [T, n] (rows_ok, same shapes)."""
    out = torch.empty(gate.shape, dtype=torch.float32)
    load().ek_silu_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
                       out.data_ptr(), gate.shape[1], gate.shape[0], gate.shape[1],
                       torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """layers/rotary.py's ``apply_rotary`` of x [T, heads, d] (heads of d contiguous values
    side by side in a row; cos and sin [T, 1, d] contiguous float32): a new [T, heads, d]."""
    T, heads, d = x.shape
    out = torch.empty((T, heads, d), dtype=torch.float32)
    load().ek_rotary(x.data_ptr(), x.stride(0), heads, d, cos.data_ptr(), sin.data_ptr(),
                     out.data_ptr(), T, torch.get_num_threads())
    return out


def rotary_ok(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (x.dim() == 3 and x.dtype == cos.dtype == sin.dtype == torch.float32
            and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.shape[2] % 2 == 0
            and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape[0] == sin.shape[0] == x.shape[0])
