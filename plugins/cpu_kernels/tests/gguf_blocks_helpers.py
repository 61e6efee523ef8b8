"""What the GGUF-block tests share: gguf-py's quantizer and dequantizer as torch (the file's
bytes, the blocks' values)."""

from __future__ import annotations

import gguf
import torch

QTYPES = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
          "q8_0": gguf.GGMLQuantizationType.Q8_0}


def gguf_bytes(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """``w`` quantized by gguf-py (llama.cpp's reference quantizers): the file's bytes."""
    return torch.from_numpy(gguf.quants.quantize(w.numpy(), QTYPES[qtype]))


def dequantized(raw: torch.Tensor, qtype: str, n: int, k: int) -> torch.Tensor:
    """The blocks' values, float32 [n, k], by gguf-py."""
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), QTYPES[qtype]).copy()
                            ).reshape(n, k).float()
