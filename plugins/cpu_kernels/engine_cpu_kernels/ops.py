"""The GEMM kernels as Python objects: pack a weight once, then run ``y = x @ W.T + bias``.

One :class:`CPUGemm` is one (weight format, instruction set) pair of ``linear_kernels.c``;
:data:`KERNELS` lists those the plugin registers, best first per weight dtype. GGUF tensors
(Q4_0, Q4_1, Q8_0) are packed from the file's bytes as they are by :func:`pack_gguf_blocks`
(``CPUGemm.pack_blocks``): no requantization. Their kernels come in two modes sharing that
packing: weight-only (``weight_only=True``: float32 activations, the blocks dequantized in
registers; the result is float32 ``x @ W.T`` within float rounding; the default) and int8
activations per block (llama.cpp's arithmetic; faster from 16 rows, about 0.5% error)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.interfaces import LinearKernel
from engine_cpu_kernels import kernel as K_
from engine_cpu_kernels.kernel import (DT_BF16, DT_F32, FEAT_AVX2, FEAT_AVX512,
                                       FEAT_AVX512_BF16, FEAT_AVX512_VNNI, FMT_BF16,
                                       FMT_BF16_PAIRS, FMT_F16, FMT_F32, FMT_Q4_0, FMT_Q4_1,
                                       FMT_Q8_0,
                                       ISA_AVX2, ISA_AVX512, WEIGHT_ONLY,
                                       ISA_SCALAR, KernelUnavailable, check_status)
from engine_cpu_kernels.quantize import (GGUF_BLOCKS, QK, quantize_gguf,  # noqa: F401
                                         quantize_q4_0, quantize_q4_1, quantize_q8_0)

FORMAT_NAMES = {FMT_F16: "float16", FMT_BF16: "bfloat16", FMT_BF16_PAIRS: "bfloat16 pairs",
                FMT_Q8_0: "q8_0", FMT_Q4_0: "q4_0", FMT_Q4_1: "q4_1", FMT_F32: "float32"}
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


def pack(weight: torch.Tensor, fmt: int, threads: int | None = None) -> Packed:
    """Pack ``weight`` [out, in] (any float dtype; rounded to the format as torch rounds; the
    block formats quantized as llama.cpp quantizes: :func:`quantize_q8_0`,
    :func:`quantize_q4_0`, :func:`quantize_q4_1`)."""
    if fmt in (FMT_Q4_0, FMT_Q4_1):
        raw = quantize_q4_0(weight) if fmt == FMT_Q4_0 else quantize_q4_1(weight)
        return pack_gguf_blocks(raw, FORMAT_NAMES[fmt], *weight.shape)
    lib = K_.load()
    n, k = weight.shape
    size = lib.ek_packed_bytes(fmt, n, k)
    check_status(min(size, 0), f"packing a {n} x {k} weight as {FORMAT_NAMES.get(fmt, fmt)}")
    out = torch.empty(size, dtype=torch.uint8)
    threads = threads or torch.get_num_threads()
    if fmt == FMT_F32:
        src = weight.detach().float().contiguous()
        status = lib.ek_pack_f32(src.data_ptr(), n, k, out.data_ptr(), threads)
    elif fmt == FMT_Q8_0:
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


def pack_gguf_blocks(raw: torch.Tensor, qtype: str, n: int, k: int) -> Packed:
    """Pack a GGUF tensor's bytes as they are in the file (``raw``: uint8, n rows of k / 32
    blocks, any shape holding them in that order) for the kernels of ``qtype`` ("q4_0",
    "q4_1" or "q8_0"): the kernels multiply by exactly the blocks' values (no
    requantization). Raises ValueError on an unknown qtype, k not a multiple of 32 or a byte
    count that is not n * k / 32 blocks."""
    if qtype not in GGUF_BLOCKS:
        raise ValueError(f"unknown GGUF block type {qtype!r}: the CPU kernels take "
                         f"{', '.join(GGUF_BLOCKS)}")
    fmt, size = GGUF_BLOCKS[qtype]
    if n <= 0 or k <= 0 or k % QK:
        raise ValueError(f"a {qtype} tensor needs n > 0 and k a positive multiple of {QK}, "
                         f"got n={n}, k={k}")
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise ValueError(f"{qtype} blocks must come as a uint8 tensor of the file's bytes, got "
                         f"{getattr(raw, 'dtype', type(raw).__name__)}")
    nb = k // QK
    if raw.numel() != n * nb * size:
        raise ValueError(f"a {n} x {k} {qtype} tensor is {n * nb * size} bytes ({n * nb} "
                         f"blocks of {size}), got {raw.numel()}")
    raw = raw.detach().reshape(n, nb, size)
    if not raw.is_contiguous() or raw.device.type != "cpu":
        raw = raw.cpu().contiguous()
    if fmt == FMT_Q8_0:
        d = raw[..., :2].contiguous().view(torch.float16).reshape(n, nb)
        q = raw[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return pack_q8_0_blocks(q, d)
    lib = K_.load()
    out = torch.empty(lib.ek_packed_bytes(fmt, n, k), dtype=torch.uint8)
    check_status(lib.ek_pack_gguf_q4(fmt, raw.data_ptr(), n, k, out.data_ptr(),
                                     torch.get_num_threads()), f"packing {qtype} blocks")
    return Packed(out, fmt, n, k)


def unpack(packed: Packed) -> torch.Tensor:
    """The weight a packed one stands for, float32 [n, k] (what the kernels multiply by)."""
    out = torch.empty(packed.n, packed.k, dtype=torch.float32)
    check_status(K_.load().ek_unpack(packed.fmt, packed.ptr, packed.n, packed.k,
                                     out.data_ptr()), "unpacking")
    return out


def run_format(fmt: int, weight_only: bool) -> int:
    """The format code a kernel runs packed ``fmt`` weights with: their weight-only mode
    (float32 activations) for the block formats with ``weight_only``."""
    if not weight_only:
        return fmt
    if fmt not in WEIGHT_ONLY:
        raise ValueError(f"weight-only runs the block formats ({', '.join(GGUF_BLOCKS)}), "
                         f"not {FORMAT_NAMES.get(fmt, fmt)}")
    return WEIGHT_ONLY[fmt]


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None,
           isa: int = ISA_AVX512, out: torch.Tensor | None = None,
           weight_only: bool = False) -> torch.Tensor:
    """``x @ W.T + bias`` for x [..., k] float32 or bfloat16 on the CPU; the result has x's dtype.
    ``weight_only`` (block formats: Q8_0, Q4_0, Q4_1): keep the activations float32 and
    dequantize the blocks in registers (the result is float32 ``x @ unpack(packed).T`` within
    float rounding) instead of quantizing the activations to int8 per block."""
    k, n = packed.k, packed.n
    fmt = run_format(packed.fmt, weight_only)
    dt = X_DTYPES.get(x.dtype)
    if dt is None or not x.is_cpu:
        raise ValueError(f"the CPU kernels take float32 or bfloat16 activations on a CPU, got "
                         f"{x.dtype} on {x.device}")
    shape = x.shape
    if shape[-1] != k:
        raise ValueError(f"x has {shape[-1]} features, the weight {k}")
    flat = len(shape) == 2  # the decode path: no reshape, no view (each costs a microsecond)
    x2 = x if flat else x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype) if out is None else out
    b = 0
    if bias is not None:
        if bias.dtype != torch.float32 or not bias.is_contiguous():
            bias = bias.detach().float().contiguous()
        b = bias.data_ptr()
    status = _linear(fmt, isa, x2.data_ptr(), dt, m, k, x2.stride(0), packed.ptr, n, b,
                     y.data_ptr(), dt, n, torch.get_num_threads())
    if status:
        check_status(status, f"{FORMAT_NAMES[packed.fmt]}{' weight-only' if weight_only else ''}"
                             f" GEMM on {ISA_LABEL.get(isa, isa)}")
    return y if flat and out is None else y.view(*shape[:-1], n)


@dataclass(eq=False)
class Group:
    """The packed weights of an MoE layer's experts (None: an expert another rank holds), all
    one format and shape, as :func:`grouped_linear` takes them: their addresses in one C
    array, built once."""

    packed: list
    fmt: int
    n: int
    k: int

    def __post_init__(self):
        self.ptrs = (ctypes.c_void_p * len(self.packed))(
            *[None if p is None else p.ptr for p in self.packed])


def group(packed: list) -> Group:
    """:class:`Group` of ``packed`` (a list of :class:`Packed` or None, one per expert)."""
    held = [p for p in packed if p is not None]
    if not held:
        raise ValueError("a group of experts needs at least one packed weight")
    shapes = {(p.fmt, p.n, p.k) for p in held}
    if len(shapes) > 1:
        raise ValueError(f"the experts' packed weights differ in format or shape: "
                         f"{sorted(shapes)}")
    return Group(list(packed), *shapes.pop())


def grouped_linear(x: torch.Tensor, grp: Group, offsets: torch.Tensor, isa: int = ISA_AVX512,
                   weight_only: bool = False) -> torch.Tensor:
    """The experts' GEMMs in one call: rows ``offsets[e]:offsets[e + 1]`` of ``x`` [R, k]
    (float32 or bfloat16; sorted by expert) times expert e's weight, into the same rows of the
    result [R, n] (x's dtype); the rows of an expert without a weight (None) are zero.
    ``offsets``: int64 [E + 1], 0 to R, ascending."""
    fmt = run_format(grp.fmt, weight_only)
    dt = X_DTYPES.get(x.dtype)
    if dt is None or not x.is_cpu or x.dim() != 2 or x.shape[1] != grp.k:
        raise ValueError(f"the grouped CPU GEMM takes float32 or bfloat16 x [rows, {grp.k}] on "
                         f"a CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    experts = len(grp.packed)
    if offsets.dtype != torch.int64 or offsets.shape != (experts + 1,) or not offsets.is_cpu:
        raise ValueError(f"offsets must be int64 [{experts + 1}] on the CPU, got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    offsets = offsets.contiguous()
    rows = x.shape[0]
    y = torch.empty((rows, grp.n), dtype=x.dtype)
    status = K_.load().ek_grouped_linear(fmt, isa, x.data_ptr(), dt, rows, grp.k, x.stride(0),
                                         grp.ptrs, offsets.data_ptr(), experts, grp.n,
                                         y.data_ptr(), dt, grp.n, torch.get_num_threads())
    if status:
        check_status(status, f"grouped {FORMAT_NAMES[grp.fmt]} GEMM on "
                             f"{ISA_LABEL.get(isa, isa)}")
    return y


def graph_nodes(packed: Packed, bias, x: torch.Tensor, y: torch.Tensor, max_rows: int,
                isa: int = ISA_AVX512, weight_only: bool = False) -> list:
    """CPU-graph nodes computing ``y[:rows] = x[:rows] @ unpack(packed).T + bias`` for the
    rows of a step (see :meth:`CPUGemm.graph_nodes`)."""
    from engine.cpu_graph import CArgs, GraphNode, GraphUnsupported

    lib = K_.load()
    fmt = run_format(packed.fmt, weight_only)
    for t, what in ((x, "x"), (y, "y")):
        if t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1 or \
                t.shape[0] < max_rows:
            raise GraphUnsupported(f"the CPU kernels' graph nodes take float32 [rows, cols] "
                                   f"buffers, got {what} {t.dtype} {tuple(t.shape)}")
    if x.shape[1] != packed.k or y.shape[1] != packed.n:
        raise GraphUnsupported(f"a {packed.n} x {packed.k} weight between buffers of "
                               f"{x.shape[1]} and {y.shape[1]} columns")
    if bias is not None:
        bias = bias.detach().float().contiguous()
    status = ctypes.c_int(0)
    args = lib.ek_linear_node_new(fmt, isa, x.data_ptr(), x.stride(0), packed.ptr, packed.n,
                                  packed.k, 0 if bias is None else bias.data_ptr(),
                                  y.data_ptr(), y.stride(0), max_rows, ctypes.byref(status))
    if status.value:
        check_status(status.value, f"a {FORMAT_NAMES[packed.fmt]} graph node on "
                                   f"{ISA_LABEL.get(isa, isa)}")
    owner = CArgs(args, lib.ek_linear_node_free, "a linear graph node")
    keep = [owner, packed, bias]
    name = f"linear {FORMAT_NAMES[packed.fmt]} {packed.n}x{packed.k}"
    nodes = []
    if lib.ek_linear_node_has_prep(args):
        nodes.append(GraphNode(_address("ek_linear_node_prep"), args, name + " (prep)", keep))
    nodes.append(GraphNode(_address("ek_linear_node_gemm"), args, name, keep))
    return nodes


def _address(fn: str) -> int:
    return ctypes.cast(getattr(K_.load(), fn), ctypes.c_void_p).value


def _linear(*args):
    global _linear
    _linear = K_.load().ek_linear  # bound once: the call is on every linear's path
    return _linear(*args)


class CPUGemm(LinearKernel):
    """One registered kernel: a weight format (``fmt``: how it packs) on one instruction set;
    ``weight_only`` (block formats): float32 activations, the blocks dequantized in registers."""

    def __init__(self, name: str, weight_dtype: str, fmt: int, isa: int, needs: int,
                 description: str, weight_only: bool = False):
        self.name, self.weight_dtype, self.fmt, self.isa = name, weight_dtype, fmt, isa
        self.needs, self.description, self.weight_only = needs, description, weight_only

    @property
    def activations(self) -> str:
        """What it multiplies the weights with (``register_linear_kernels``' ``activations``):
        "int8" for the block formats' llama.cpp kernels (activations quantized per block of
        32), "float32" for the others (float16 / bfloat16 weights, weight-only blocks)."""
        return "float32" if self.weight_only or self.weight_dtype not in GGUF_BLOCKS else "int8"

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
        """A float weight: rounded (float16 / bfloat16) or quantized as llama.cpp quantizes
        (q8_0 / q4_0 / q4_1: see :func:`pack`)."""
        return pack(weight, self.fmt)

    def pack_blocks(self, raw: torch.Tensor, qtype: str, n: int, k: int) -> Packed:
        """A GGUF tensor's blocks as they are in the file (uint8 bytes, n rows of k / 32
        blocks of ``qtype``): :func:`pack_gguf_blocks`. ``qtype`` must be this kernel's
        weight dtype."""
        if qtype != self.weight_dtype:
            raise ValueError(f"the {self.name} kernel runs {self.weight_dtype} blocks, not "
                             f"{qtype!r}")
        return pack_gguf_blocks(raw, qtype, n, k)

    def linear(self, x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None):
        return linear(x, packed, bias, self.isa, None, self.weight_only)

    def packed_bytes(self, packed: Packed) -> int:
        return packed.nbytes

    def group(self, packed: list) -> Group:
        """An MoE layer's experts' packed weights (None: absent) for :meth:`grouped_linear`."""
        return group(packed)

    def grouped_linear(self, x: torch.Tensor, grp: Group, offsets: torch.Tensor):
        """Every expert's rows of ``x`` (sorted by expert, ``offsets`` [E + 1]) times its
        weight, in one call into C: :func:`grouped_linear`."""
        return grouped_linear(x, grp, offsets, self.isa, self.weight_only)

    def graph_nodes(self, packed: Packed, bias, x: torch.Tensor, y: torch.Tensor,
                    max_rows: int) -> list:
        """The CPU-graph nodes of this linear (engine.cpu_graph): ``y[:rows] = x[:rows] @
        W.T + bias``, float32 buffers; a preparing node first where the kernel reads
        prepared activations (int8 blocks, bfloat16 pairs, Q4_1 block sums)."""
        return graph_nodes(packed, bias, x, y, max_rows, self.isa, self.weight_only)


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
    CPUGemm("avx512_f32", "float32", FMT_F32, ISA_AVX512, A512,
            "float32 weights, AVX-512 FMA"),
    CPUGemm("avx2_f32", "float32", FMT_F32, ISA_AVX2, A2,
            "float32 weights, AVX2 FMA"),
    CPUGemm("avx512_q8_0", "q8_0", FMT_Q8_0, ISA_AVX512, A512 | FEAT_AVX512_VNNI,
            "Q8_0 blocks x int8 activations per block, vpdpbusd (AVX512_VNNI)"),
    CPUGemm("avx2_q8_0", "q8_0", FMT_Q8_0, ISA_AVX2, A2,
            "Q8_0 blocks x int8 activations per block, vpmaddubsw (AVX2)"),
    CPUGemm("avx512_q4_1", "q4_1", FMT_Q4_1, ISA_AVX512, A512 | FEAT_AVX512_VNNI,
            "Q4_1 blocks x int8 activations per block (Q8_1-style sums), vpdpbusd "
            "(AVX512_VNNI)"),
    CPUGemm("avx2_q4_1", "q4_1", FMT_Q4_1, ISA_AVX2, A2,
            "Q4_1 blocks x int8 activations per block (Q8_1-style sums), vpmaddubsw (AVX2)"),
    CPUGemm("avx512_q4_0", "q4_0", FMT_Q4_0, ISA_AVX512, A512 | FEAT_AVX512_VNNI,
            "Q4_0 blocks x int8 activations per block, vpdpbusd (AVX512_VNNI)"),
    CPUGemm("avx2_q4_0", "q4_0", FMT_Q4_0, ISA_AVX2, A2,
            "Q4_0 blocks x int8 activations per block, vpmaddubsw (AVX2)"),
]
# weight-only: the same packing, float32 activations (the engine's default for GGUF blocks: the
# result is the dequantized float32 model's within float rounding)
KERNELS += [
    CPUGemm(f"{label}_{name}_f32", name, fmt, isa, needs,
            f"{name.upper()} blocks dequantized in registers, float32 activations, {what} FMA",
            weight_only=True)
    for name, fmt in (("q4_1", FMT_Q4_1), ("q4_0", FMT_Q4_0), ("q8_0", FMT_Q8_0))
    for label, isa, needs, what in (("avx512", ISA_AVX512, A512, "AVX-512"),
                                    ("avx2", ISA_AVX2, A2, "AVX2"))]
