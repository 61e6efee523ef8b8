"""Build the C GEMM library once per machine and load it with ctypes.

Built by ``engine.native.build_library`` (the system C compiler, into ``<engine cache>/kernels``,
keyed by the source, the flags and the compiler's version). Nothing is built for the build
machine's CPU (no ``-march``): the AVX2 and AVX-512 functions carry their own target attributes, and which
ones run is decided at run time from cpuid (``features()``), so one build runs on any x86-64.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

import torch  # loaded first, so the library's OpenMP dependency resolves to torch's own runtime

from engine.cpu_graph import header_key, include_dir
from engine.native import BuildError as KernelUnavailable  # noqa: F401 - this plugin's name
from engine.native import build_library

SOURCE = Path(__file__).with_name("linear_kernels.c")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno"]

# formats, instruction sets, dtypes and status codes of linear_kernels.c
FMT_F16, FMT_BF16, FMT_BF16_PAIRS, FMT_Q8_0, FMT_Q4_0, FMT_Q4_1 = 0, 1, 2, 3, 4, 5
# weight-only modes of the block formats for ek_linear: the same packed bytes (FMT_Q8_0 /
# FMT_Q4_0 / FMT_Q4_1), float32 activations, weights dequantized in registers
FMT_Q8_0_F32, FMT_Q4_0_F32, FMT_Q4_1_F32 = 6, 7, 8
WEIGHT_ONLY = {FMT_Q8_0: FMT_Q8_0_F32, FMT_Q4_0: FMT_Q4_0_F32, FMT_Q4_1: FMT_Q4_1_F32}
FMT_F32 = 9  # float32 weights in k-major tiles (a float32 model's linears and MoE experts)
ISA_SCALAR, ISA_AVX2, ISA_AVX512 = 0, 1, 2
DT_F32, DT_BF16 = 0, 1
FEAT_AVX2, FEAT_AVX512, FEAT_AVX512_BF16, FEAT_AVX512_VNNI = 1, 2, 4, 8
ERRORS = {-1: "unknown weight format", -2: "instruction set not available on this CPU",
          -3: "K (in_features) must be a multiple of 32 for a block format",
          -4: "out of memory", -5: "unsupported",
          -6: "bad arguments (expert row offsets not ascending from 0 to the rows)"}
ISA_NAMES = {"scalar": ISA_SCALAR, "avx2": ISA_AVX2, "avx512": ISA_AVX512}
ISA_ENV = "ENGINE_CPU_ISA"  # "avx2" / "scalar": cap the instruction set (tests, comparisons)


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    """The loaded library; raises KernelUnavailable with the reason."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelUnavailable(f"its kernels are x86-64 code, and this is {platform.machine()}")
    # no -march: any x86-64 runs it; graph.h (the CPU graph's node ABI) from the core
    target = build_library(SOURCE, [*FLAGS, "-I", include_dir()], "its kernels",
                           key_extra=header_key())
    lib = ctypes.CDLL(str(target))
    P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ek_features.argtypes, lib.ek_features.restype = [], INT
    lib.ek_packed_bytes.argtypes, lib.ek_packed_bytes.restype = [INT, I64, I64], I64
    lib.ek_pack_half.argtypes, lib.ek_pack_half.restype = [INT, P, I64, I64, P, INT], INT
    lib.ek_pack_q8_0.argtypes, lib.ek_pack_q8_0.restype = [P, P, I64, I64, P, INT], INT
    lib.ek_pack_gguf_q4.argtypes, lib.ek_pack_gguf_q4.restype = [INT, P, I64, I64, P, INT], INT
    lib.ek_pack_f32.argtypes, lib.ek_pack_f32.restype = [P, I64, I64, P, INT], INT
    lib.ek_grouped_linear.argtypes = [INT, INT, P, INT, I64, I64, I64, P, P, I64, I64, P, INT,
                                      I64, INT]
    lib.ek_grouped_linear.restype = INT
    lib.ek_unpack.argtypes, lib.ek_unpack.restype = [INT, P, I64, I64, P], INT
    lib.ek_linear.argtypes = [INT, INT, P, INT, I64, I64, I64, P, I64, P, P, INT, I64, INT]
    lib.ek_linear.restype = INT
    lib.ek_peak.argtypes, lib.ek_peak.restype = [INT, I64, INT], ctypes.c_double
    lib.ek_linear_node_new.argtypes = [INT, INT, P, I64, P, I64, I64, P, P, I64, I64,
                                       ctypes.POINTER(INT)]
    lib.ek_linear_node_new.restype = P
    lib.ek_linear_node_free.argtypes, lib.ek_linear_node_free.restype = [P], None
    lib.ek_linear_node_has_prep.argtypes, lib.ek_linear_node_has_prep.restype = [P], INT
    return lib


def features() -> int:
    """The FEAT_* bits this CPU has (cpuid, through __builtin_cpu_supports)."""
    return load().ek_features()


def isa_cap() -> int:
    """The highest instruction set to use: ISA_AVX512, or less where $ENGINE_CPU_ISA says."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced in ("", "auto", "native"):
        return ISA_AVX512
    if forced not in ISA_NAMES:
        raise KernelUnavailable(f"{ISA_ENV}={forced!r} is not one of auto, "
                                f"{', '.join(ISA_NAMES)}")
    return ISA_NAMES[forced]


def check_status(status: int, what: str) -> None:
    if status != 0:
        raise ValueError(f"{what}: {ERRORS.get(status, f'error {status}')}")


PEAK_KINDS = {"avx2 FMA (fp32)": 0, "avx512 FMA (fp32)": 1, "avx512 vdpbf16ps": 2,
              "avx512 vpdpbusd (int8)": 3, "avx2 vpmaddubsw (int8)": 4}


def peak(kind: str, threads: int, seconds: float = 0.2, reps: int = 5) -> float | None:
    """The machine's arithmetic peak for one instruction, in GFLOP/s (int8: GOP/s), measured:
    the best of ``reps`` runs of 12 independent chains per thread on ``threads`` threads;
    None when this CPU lacks it."""
    import time

    lib, code, iters = load(), PEAK_KINDS[kind], 1 << 16
    if lib.ek_peak(code, 1, 1) < 0:
        return None
    start = time.perf_counter()
    lib.ek_peak(code, iters, threads)
    iters = max(iters, int(iters * seconds / max(time.perf_counter() - start, 1e-6)))
    best = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        ops = lib.ek_peak(code, iters, threads)
        best = max(best, ops / (time.perf_counter() - start) / 1e9)
    return best
