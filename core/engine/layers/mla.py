"""Multi-head latent attention (MLA, DeepSeek-V2/V3), absorbed: the KV pool holds one row per
token, the compressed latent c (``kv_lora_rank`` values, after ``kv_a_layernorm``) and the
rotated rope key (``qk_rope_head_dim``, shared by the heads). ``kv_b_proj`` is never applied to
the keys: its key half W_UK is folded into each head's query (q_nope W_UK: the query in the
latent space) and its value half W_UV is applied to each head's output, a weighted sum of
latents. So the backend attends every row, prompt and decode alike, as multi-query attention
over the latent rows (``AttentionBackend.forward_latent``), and no per-head K or V is ever
built: per (query, key) pair that is H x (2 kv_lora_rank + rope) multiply-adds instead of the
decompressed H x (qk_head_dim + v_head_dim), which a long prompt's chunks pay (decompressing
them is a later optimization); a decode step reads kv_lora_rank + rope values per key.

Module names follow the HF checkpoints: ``q_proj`` (or ``q_a_proj``, ``q_a_layernorm``,
``q_b_proj`` with a q LoRA), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``; the projections of the hidden states (q's or q_a's, and kv_a's) are one packed
``MergedLinear`` where they share a bias setting. ``kv_b_proj`` is a plain weight
(``LatentProjection``), read as W_UK and W_UV: prepacking or a quantization method never repacks it.
Rope dimensions in DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... are regrouped into
halves before rotating (q and k alike, so every score is transformers' own).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention import get_forward_context
from engine.layers.linear import Linear, MergedLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import apply_rotary

LORA_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (transformers: the default)


class LatentProjection(nn.Module):
    """``kv_b_proj``: weight [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]."""

    def __init__(self, kv_lora_rank: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, kv_lora_rank), requires_grad=False)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...) on the last dimension."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


@torch.compiler.disable  # the backend writes the pool and reads per-step metadata
def latent_attention(q: torch.Tensor, latent: torch.Tensor, layer_id: int) -> torch.Tensor:
    ctx = get_forward_context()
    return ctx.backend.forward_latent(q, latent, layer_id, ctx.batch)


class MLAttention(nn.Module):
    def __init__(self, config, layer_id: int):
        """``config``: a ModelConfig with ``mla`` (models/deepseek_config.py)."""
        super().__init__()
        m, hidden, H = config.mla, config.hidden_size, config.num_heads
        self.layer_id, self.num_heads, self.mla = layer_id, H, m
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q_name, q_rows = ("q_a_proj", m.q_lora_rank) if m.q_lora_rank else ("q_proj", H * qk)
        kv_rows = m.kv_lora_rank + m.qk_rope_head_dim
        # q_proj has no bias; q_a_proj and kv_a_proj_with_mqa have attention_bias
        if m.q_lora_rank or not m.attention_bias:
            self.qkv_a_proj = MergedLinear(hidden, {q_name: q_rows, "kv_a_proj_with_mqa": kv_rows},
                                           m.attention_bias)
        else:
            self.q_proj = Linear(hidden, H * qk)
            self.kv_a_proj_with_mqa = Linear(hidden, kv_rows, True)
        if m.q_lora_rank:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(m.q_lora_rank, H * qk)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = LatentProjection(m.kv_lora_rank,
                                          H * (m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = Linear(H * m.v_head_dim, hidden, m.attention_bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H, nope + rope], compressed kv [T, kv_lora_rank + rope]) of ``x``."""
        m = self.mla
        if hasattr(self, "qkv_a_proj"):
            q, kv = self.qkv_a_proj.forward_split(x)
        else:
            q, kv = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        if m.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q.view(x.shape[0], self.num_heads, -1), kv

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]; cos, sin [T, 1, qk_rope_head_dim] -> [T, hidden]."""
        m, H, T = self.mla, self.num_heads, x.shape[0]
        nope, r = m.qk_nope_head_dim, m.kv_lora_rank
        q, kv = self.project(x)
        q_rope, k_rope = q[..., nope:], kv[:, None, r:]
        if m.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rotary(q_rope, cos, sin), apply_rotary(k_rope, cos, sin)
        w = self.kv_b_proj.weight.view(H, nope + m.v_head_dim, r)
        # each head's query in the latent space: q_nope [H, T, nope] @ W_UK [H, nope, r]
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope]).transpose(0, 1)
        latent = torch.cat([self.kv_a_layernorm(kv[:, :r]), k_rope[:, 0]], -1)
        out = latent_attention(torch.cat([q_latent, q_rope], -1), latent[:, None], self.layer_id)
        # W_UV after attention: [H, T, r] @ [H, r, v]
        out = torch.bmm(out.transpose(0, 1), w[:, nope:].transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(T, H * m.v_head_dim))
