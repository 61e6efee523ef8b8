"""GGUF's block formats (Q8_0, Q4_0, Q4_1: blocks of 32 weights along K) and a float weight
quantized into them as llama.cpp's reference quantizers (and gguf-py) do, byte for byte: what
``ops.pack`` packs a float weight from, and what tests and benchmarks compare the kernels with."""

from __future__ import annotations

import torch

from engine_cpu_kernels.kernel import FMT_Q4_0, FMT_Q4_1, FMT_Q8_0

QK = 32  # weights per block of the block formats
# GGUF block types the kernels run as they are: (format, bytes per block of 32 weights)
GGUF_BLOCKS = {"q4_0": (FMT_Q4_0, 18), "q4_1": (FMT_Q4_1, 20), "q8_0": (FMT_Q8_0, 34)}


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


def _blocks(weight: torch.Tensor, what: str) -> torch.Tensor:
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"{what} needs in_features to be a multiple of {QK}, got {k}")
    return weight.detach().float().reshape(n, k // QK, QK)


def _gguf_bytes(*fields: torch.Tensor) -> torch.Tensor:
    """[n, nb] float16 fields and [n, nb, 16] nibble bytes -> the GGUF rows [n, nb * size]."""
    parts = [f.to(torch.float16).unsqueeze(-1).view(torch.uint8) if f.dim() == 2 else f
             for f in fields]
    cat = torch.cat(parts, -1)
    return cat.reshape(cat.shape[0], -1).contiguous()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[n, nb, 32] values 0..15 -> GGUF qs [n, nb, 16]: weight j low, weight j + 16 high."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def quantize_q4_0(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 bytes [N, K / 32 * 18] as llama.cpp's quantize_row_q4_0_ref (and gguf-py)
    make them: per block, d = w[argmax |w|] / -8, q = min(15, trunc(w / d + 8.5))."""
    w = _blocks(weight, "Q4_0")
    mx = w.gather(-1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = mx / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = (w * inv[..., None] + 8.5).trunc().clamp(0, 15)
    return _gguf_bytes(d, _nibbles(q))


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 bytes [N, K / 32 * 20] as llama.cpp's quantize_row_q4_1_ref (and gguf-py)
    make them: per block, m = min w, d = (max w - m) / 15, q = min(15, trunc((w - m) / d + .5))."""
    w = _blocks(weight, "Q4_1")
    lo, hi = w.amin(-1), w.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = ((w - lo[..., None]) * inv[..., None] + 0.5).trunc().clamp(0, 15)
    return _gguf_bytes(d, lo, _nibbles(q))


def quantize_gguf(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """``weight`` [N, K] as a GGUF tensor of ``qtype`` ("q4_0", "q4_1", "q8_0") would hold it:
    the file's bytes, uint8 [N, K / 32 * block bytes] (llama.cpp's reference quantizers)."""
    if qtype == "q4_0":
        return quantize_q4_0(weight)
    if qtype == "q4_1":
        return quantize_q4_1(weight)
    if qtype == "q8_0":
        q, d = quantize_q8_0(weight)
        n, k = q.shape
        return _gguf_bytes(d, q.view(torch.uint8).reshape(n, k // QK, QK))
    raise ValueError(f"unknown GGUF block type {qtype!r}: the CPU kernels take "
                     f"{', '.join(GGUF_BLOCKS)}")
