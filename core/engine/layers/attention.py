"""The attention layer: projects nothing, hands q/k/v to the attention backend of the current
forward. The runner sets that backend and batch around each forward (``forward_context``), so
model code never passes them down through every layer."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch
    from engine.interfaces import AttentionBackend


@dataclass
class ForwardContext:
    backend: "AttentionBackend"
    batch: "ForwardBatch"


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention ran outside forward_context(); use ModelRunner.forward"
    return _current


@contextmanager
def forward_context(backend: "AttentionBackend", batch: "ForwardBatch"):
    global _current
    assert _current is None, "forward_context() is not re-entrant"
    _current = ForwardContext(backend, batch)
    try:
        yield _current
    finally:
        _current = None


class Attention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # the checkpoint's KV-cache scales (stored = real / scale), None when it has none; the
        # runner copies them into the pool when the KV dtype stores scaled values
        self.k_scale: float | None = None
        self.v_scale: float | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads, head_dim]."""
        if torch.compiler.is_compiling():
            return attention_op(q, k, v, self.layer_id)
        ctx = get_forward_context()
        return ctx.backend.forward(q, k, v, self.layer_id, ctx.batch)


@torch.library.custom_op("engine::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 layer_id: int) -> torch.Tensor:
    """The backend's attention as one opaque op, so that torch.compile traces the layers around
    it without tracing the backend (which writes the KV pool and reads per-step metadata). Rows
    past the batch's tokens are padding: they attend nothing and come back as zeros."""
    ctx = get_forward_context()
    n = ctx.batch.num_tokens
    out = ctx.backend.forward(q[:n], k[:n], v[:n], layer_id, ctx.batch)
    if q.shape[0] > n:
        out = torch.cat([out, out.new_zeros(q.shape[0] - n, *out.shape[1:])])
    return out


@attention_op.register_fake
def _(q, k, v, layer_id):
    return torch.empty_like(q)
