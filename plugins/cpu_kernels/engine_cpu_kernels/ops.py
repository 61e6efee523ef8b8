"""The GEMM kernels as Python objects: pack a weight once, then run ``y = x @ W.T + bias``.

One :class:`CPUGemm` is one (weight format, instruction set) pair of ``linear_kernels.c``;
:data:`KERNELS` lists those the plugin registers, best first per weight dtype."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.interfaces import LinearKernel
from engine_cpu_kernels import kernel as K_
from engine_cpu_kernels.kernel import (DT_BF16, DT_F32, FEAT_AVX2, FEAT_AVX512,
                                       FEAT_AVX512_BF16, FEAT_AVX512_VNNI, FMT_BF16,
                                       FMT_BF16_PAIRS, FMT_F16, FMT_Q8_0, ISA_AVX2, ISA_AVX512,
                                       ISA_SCALAR, KernelUnavailable, check_status)

QK = 32  # weights per block of the block formats
FORMAT_NAMES = {FMT_F16: "float16", FMT_BF16: "bfloat16", FMT_BF16_PAIRS: "bfloat16 pairs",
                FMT_Q8_0: "q8_0"}
ISA_LABEL = {ISA_SCALAR: "scalar", ISA_AVX2: "avx2", ISA_AVX512: "avx512"}
X_DTYPES = {torch.float32: DT_F32, torch.bfloat16: DT_BF16}


@dataclass(eq=False)
class Packed:
    """A weight [n, k] packed for one format: ``data`` holds the bytes (uint8)."""

    data: torch.Tensor
    fmt: int
    n: int
    k: int

    def __post_init__(self):
        self.ptr = self.data.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 as llama.cpp's quantize_row_q8_0 makes it: per block of 32 along K,
    d = max|w| / 127 (stored as float16), q = round(w / d) (halves away from zero).
    Returns q int8 [N, K] and d float16 [N, K / 32]."""
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"Q8_0 needs in_features to be a multiple of {QK}, got {k}")
    w = weight.detach().float().reshape(n, k // QK, QK)
    d = w.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    scaled = w * inv[..., None]
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
    return q.reshape(n, k).contiguous(), d.to(torch.float16).contiguous()


def pack(weight: torch.Tensor, fmt: int, threads: int | None = None) -> Packed:
    """Pack ``weight`` [out, in] (any float dtype; rounded to the format as torch rounds)."""
    lib = K_.load()
    n, k = weight.shape
    size = lib.ek_packed_bytes(fmt, n, k)
    check_status(min(size, 0), f"packing a {n} x {k} weight as {FORMAT_NAMES.get(fmt, fmt)}")
    out = torch.empty(size, dtype=torch.uint8)
    threads = threads or torch.get_num_threads()
    if fmt == FMT_Q8_0:
        q, d = quantize_q8_0(weight)
        status = lib.ek_pack_q8_0(q.data_ptr(), d.data_ptr(), n, k, out.data_ptr(), threads)
    else:
        half = torch.float16 if fmt == FMT_F16 else torch.bfloat16
        src = weight.detach().to(half).contiguous()
        status = lib.ek_pack_half(fmt, src.data_ptr(), n, k, out.data_ptr(), threads)
    check_status(status, "packing")
    return Packed(out, fmt, n, k)


def pack_q8_0_blocks(q: torch.Tensor, d: torch.Tensor) -> Packed:
    """Pack Q8_0 blocks as they are (a GGUF tensor's int8 values [N, K] and float16 scales
    [N, K / 32]): no requantization."""
    lib = K_.load()
    n, k = q.shape
    q, d = q.to(torch.int8).contiguous(), d.to(torch.float16).contiguous()
    size = lib.ek_packed_bytes(FMT_Q8_0, n, k)
    check_status(min(size, 0), "packing Q8_0 blocks")
    out = torch.empty(size, dtype=torch.uint8)
    check_status(lib.ek_pack_q8_0(q.data_ptr(), d.data_ptr(), n, k, out.data_ptr(),
                                  torch.get_num_threads()), "packing Q8_0 blocks")
    return Packed(out, FMT_Q8_0, n, k)


def unpack(packed: Packed) -> torch.Tensor:
    """The weight a packed one stands for, float32 [n, k] (what the kernels multiply by)."""
    out = torch.empty(packed.n, packed.k, dtype=torch.float32)
    check_status(K_.load().ek_unpack(packed.fmt, packed.ptr, packed.n, packed.k,
                                     out.data_ptr()), "unpacking")
    return out


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None,
           isa: int = ISA_AVX512, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for x [..., k] float32 or bfloat16 on the CPU; the result has x's dtype."""
    k, n = packed.k, packed.n
    dt = X_DTYPES.get(x.dtype)
    if dt is None or x.device.type != "cpu":
        raise ValueError(f"the CPU kernels take float32 or bfloat16 activations on a CPU, got "
                         f"{x.dtype} on {x.device}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype) if out is None else out
    b = 0
    if bias is not None:
        bias = bias.detach().float().contiguous()
        b = bias.data_ptr()
    status = _linear(packed.fmt, isa, x2.data_ptr(), dt, m, k, x2.stride(0), packed.ptr, n, b,
                     y.data_ptr(), dt, n, torch.get_num_threads())
    if status:
        check_status(status, f"{FORMAT_NAMES[packed.fmt]} GEMM on {ISA_LABEL.get(isa, isa)}")
    return y.view(*x.shape[:-1], n)


def _linear(*args):
    global _linear
    _linear = K_.load().ek_linear  # bound once: the call is on every linear's path
    return _linear(*args)


class CPUGemm(LinearKernel):
    """One registered kernel: a weight format on one instruction set."""

    def __init__(self, name: str, weight_dtype: str, fmt: int, isa: int, needs: int,
                 description: str):
        self.name, self.weight_dtype, self.fmt, self.isa = name, weight_dtype, fmt, isa
        self.needs, self.description = needs, description

    def unavailable_reason(self) -> str | None:
        try:
            have = K_.features()
            cap = K_.isa_cap()
        except KernelUnavailable as e:
            return str(e)
        if self.isa > cap:
            return f"{K_.ISA_ENV}={ISA_LABEL[cap]} limits the kernels to {ISA_LABEL[cap]}"
        missing = [label for bit, label in ((FEAT_AVX2, "AVX2+FMA+F16C"),
                                            (FEAT_AVX512, "AVX-512F/BW/VL"),
                                            (FEAT_AVX512_BF16, "AVX512_BF16"),
                                            (FEAT_AVX512_VNNI, "AVX512_VNNI"))
                   if self.needs & bit and not have & bit]
        if missing:
            return f"this CPU has no {', '.join(missing)}"
        return None

    def check(self, device) -> str | None:
        if getattr(device, "is_cuda", False) or getattr(device, "type", "cpu") != "cpu":
            return f"a CPU kernel, and this is {getattr(device, 'type', None) or 'cuda'}"
        return self.unavailable_reason()

    def pack(self, weight: torch.Tensor) -> Packed:
        return pack(weight, self.fmt)

    def linear(self, x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None):
        return linear(x, packed, bias, self.isa)

    def packed_bytes(self, packed: Packed) -> int:
        return packed.nbytes


A2 = FEAT_AVX2
A512 = FEAT_AVX2 | FEAT_AVX512
KERNELS = [
    CPUGemm("avx512_bf16", "bfloat16", FMT_BF16_PAIRS, ISA_AVX512, A512 | FEAT_AVX512_BF16,
            "bfloat16 weights, vdpbf16ps (AVX512_BF16), float32 accumulation"),
    CPUGemm("avx512_bf16_fma", "bfloat16", FMT_BF16, ISA_AVX512, A512,
            "bfloat16 weights widened to float32, AVX-512 FMA"),
    CPUGemm("avx2_bf16", "bfloat16", FMT_BF16, ISA_AVX2, A2,
            "bfloat16 weights widened to float32, AVX2 FMA"),
    CPUGemm("avx512_fp16", "float16", FMT_F16, ISA_AVX512, A512,
            "float16 weights converted to float32 (vcvtph2ps), AVX-512 FMA"),
    CPUGemm("avx2_fp16", "float16", FMT_F16, ISA_AVX2, A2,
            "float16 weights converted to float32 (F16C), AVX2 FMA"),
    CPUGemm("avx512_q8_0", "q8_0", FMT_Q8_0, ISA_AVX512, A512 | FEAT_AVX512_VNNI,
            "Q8_0 blocks x int8 activations per block, vpdpbusd (AVX512_VNNI)"),
    CPUGemm("avx2_q8_0", "q8_0", FMT_Q8_0, ISA_AVX2, A2,
            "Q8_0 blocks x int8 activations per block, vpmaddubsw (AVX2)"),
]
