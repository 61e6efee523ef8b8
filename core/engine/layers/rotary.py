"""Rotary position embedding (the half-split "neox" layout HF Llama checkpoints use), with
linear and llama3 frequency scaling, or explicit per-frequency factors (GGUF's rope_freqs).
cos/sin are cached per position and looked up by ``positions``, so requests at different offsets
share one batch."""

from __future__ import annotations

import math

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":  # what llama.cpp stores for Llama 3.1: inv_freq is divided by them
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    assert kind == "llama3", kind
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    # Llama 3.1: wavelengths longer than old_len/low are stretched by `factor`, shorter than
    # old_len/high are kept, and the band between is interpolated smoothly
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos_sin", torch.empty(2, max_positions, head_dim // 2),
                             persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the cache; the loader calls this after materializing a meta-built model."""
        if self.cos_sin.is_meta:
            return
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling)
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        self.cos_sin = torch.stack([freqs.cos(), freqs.sin()]).to(self.cos_sin.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(cos, sin), each [T, 1, head_dim] for ``apply_rotary``: the half-width values
        twice, sin's first half negated; computed in float32 and cast to ``dtype`` (the
        rotation then runs in the activations' dtype, as in the HF reference). Once per
        forward, for every layer."""
        cs = self.cos_sin[:, positions]
        sign = torch.ones(2, 1, cs.shape[-1] * 2, device=cs.device)
        sign[1, :, : cs.shape[-1]] = -1
        cs = (torch.cat((cs, cs), -1) * sign).to(dtype).unsqueeze(2)
        return cs[0], cs[1]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] (q, k, or both side by side: one call rotates them all);
    cos, sin: [T, 1, head_dim] from RotaryEmbedding, in x's dtype. HF's ``x * cos +
    rotate_half(x) * sin`` bit for bit (rotate_half(x) * sin = (x2, x1) * (-sin, sin)), in
    four ops where the half-width form took ten."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin
