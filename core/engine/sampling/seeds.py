"""Seeded sampling without a generator: a request's draw at output position ``k`` is a
counter-based hash of (seed, k), computed for all seeded rows of a step at once on the logits'
device. A request therefore gets the same tokens for its seed whatever runs beside it, in
whatever order, on any device, and seeds cost no extra kernel per row and no torch.Generator.

The hash is splitmix64 (Steele, Lea, Flood; the finaliser of java.util.SplittableRandom): the
seed's key is splitmix64's output for the seed, and position ``k`` takes the ``k+1``-th element of
the stream that key starts. In torch int64 arithmetic multiplication wraps modulo 2**64 as in
uint64 (two's complement), and ``>>`` is arithmetic on signed ints, so every shift is masked to
the bits a logical shift keeps.

A seeded row samples by inverse transform: with u from the hash, the token is the first whose
cumulative probability exceeds u * (total probability), one uniform per row instead of one
per (row, token).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
UNIFORM_BITS = 24  # float32 holds them exactly: u = k / 2**24 in [0, 1 - 2**-24]


def _signed(value: int) -> int:
    """``value`` mod 2**64 as the int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix_py(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def seed_key(seed: int) -> int:
    """The int64 key of a request's seed (any int: taken mod 2**64, as the API's range allows
    [-2**63, 2**64))."""
    return _signed(_mix_py(seed + _GOLDEN))


def uniform_reference(seed: int, position: int) -> float:
    """Pure-Python ``counter_uniform`` (what the tensor version must equal, bit for bit)."""
    z = _mix_py(seed_key(seed) + (position + 1) * _GOLDEN)
    return (z >> (64 - UNIFORM_BITS)) / (1 << UNIFORM_BITS)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniform(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1 - 2**-24], one per (key, position) pair (int64 tensors of one
    shape, on any device); a pure function of the pair."""
    z = keys + (positions + 1) * _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    z = z ^ _shr(z, 31)
    return _shr(z, 64 - UNIFORM_BITS).to(torch.float32) * (1.0 / (1 << UNIFORM_BITS))


def sample_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds ``uniform`` times the row's
    total: token i with probability p_i / sum(p). probs [S, V] >= 0 with a positive sum;
    uniform [S] in [0, 1 - 2**-24] (so that u * total < total in float32: the pick never
    falls past the last token with a positive probability, nor on a zero one)."""
    cdf = probs.cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
