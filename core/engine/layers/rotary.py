"""Rotary position embedding (the half-split "neox" layout HF Llama checkpoints use), with
linear, llama3 and yarn frequency scaling (yarn's attention factor scales cos and sin, as
transformers does), or explicit per-frequency factors (GGUF's rope_freqs).
cos/sin are cached per position and looked up by ``positions``, so requests at different offsets
share one batch."""

from __future__ import annotations

import math

import torch

from engine.layers.activation import cpu_ops, gpu_ops
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return yarn_inverse_frequencies(head_dim, theta, scaling)
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


def yarn_inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): frequencies rotating fewer than
    ``beta_slow`` times over the pretrained context are interpolated (divided by ``factor``),
    more than ``beta_fast`` times kept, a linear ramp between."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: yarn's ``attention_factor``, else derived from
    ``mscale`` / ``mscale_all_dim`` (DeepSeek) or the factor alone; 1 for the other types."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


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
        scale = attention_factor(self.scaling)
        self.cos_sin = (torch.stack([freqs.cos(), freqs.sin()]) * scale).to(self.cos_sin.device)

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
    four ops where the half-width form took ten; on CUDA one kernel (layers/fused_triton.py), on a
    CPU one C loop (layers/cpu_fused.py)."""
    if x.is_cuda and x.dim() == 3 and x.stride(-1) == 1 and cos.is_contiguous() and \
            sin.is_contiguous() and cos.dtype == sin.dtype == x.dtype and x.shape[-1] % 2 == 0:
        ops = gpu_ops()
        if ops is not None:
            return ops.rotary(x, cos, sin)
    elif x.device.type == "cpu":
        ops = cpu_ops()
        if ops is not None and ops.rotary_ok(x, cos, sin):
            return ops.rotary(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin
