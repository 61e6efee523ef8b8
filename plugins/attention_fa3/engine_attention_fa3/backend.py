"""Attention backend 'fa3': every row of a step (prompt chunks over a cached prefix, decodes) in
one call per layer of FlashAttention-3's paged ``flash_attn_with_kvcache`` (sgl-kernel), K/V
read in place from the pool viewed as [pages, page_size, KV heads, head dim].

The new tokens' K/V are written with ``pool.set_kv`` first, so the kernel gets ``k=v=None`` and
``cache_seqlens`` counts them. Queries are cast to the pool's dtype (the kernel wants one dtype
for q and the cache); for an fp8 pool the per-layer K/V scales go in as descales and the
kernel's bfloat16 output is cast back to the model's dtype.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.forward_batch import ForwardBatch
from engine.interfaces import AttentionBackend, BackendContext
from engine.registry import BackendUnavailable, IncompatibleOptions

from engine_attention_fa3.metadata import FA3GraphBuffers, FA3Metadata

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def check_context(ctx: BackendContext) -> None:
    """Refuse, with the fix, a pool or layer the FA3 kernel cannot serve."""
    if ctx.kv_pool.dtype not in KERNEL_DTYPES:
        raise IncompatibleOptions(
            f"'fa3' needs a float16, bfloat16 or fp8_e4m3 KV cache, found {ctx.kv_pool.dtype}: "
            f"use --dtype bfloat16 (or float16), or --kv-cache-dtype bf16 / fp8_e4m3.")
    for spec in ctx.layers:
        if spec.head_dim % 8 or spec.head_dim > 256:
            raise IncompatibleOptions(
                f"'fa3' needs a head dim that is a multiple of 8 and at most 256, "
                f"found {spec.head_dim}.")


def load_kernel() -> Callable:
    try:
        from sgl_kernel.flash_attn import flash_attn_with_kvcache
    except (ImportError, OSError) as e:  # OSError: an extension built for another torch
        raise BackendUnavailable(
            f"'fa3' cannot load FlashAttention-3 from sgl-kernel ({e}); install the sgl-kernel "
            f"built for this torch: pip install 'engine-attention-fa3[cuda]'") from e
    return flash_attn_with_kvcache


class FA3Backend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, ctx: BackendContext, attn_fn: Callable | None = None):
        super().__init__(ctx)
        self.kv_pool = ctx.kv_pool
        self.layers = ctx.layers
        self.attn_fn = attn_fn or load_kernel()
        self.meta: FA3Metadata | None = None
        self.graph: FA3GraphBuffers | None = None
        self.graph_meta: dict[int, FA3Metadata] = {}
        pool = ctx.kv_pool
        # per layer (1.0, k_scale, v_scale) on the device: descales are views of these, so a
        # captured graph reads fixed memory; refreshed in place when the pool's scales change
        self.scales = torch.ones(pool.num_layers, 3, dtype=torch.float32, device=pool.device)
        self.scales_host: list | None = None

    # -- per step ------------------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.meta = FA3Metadata.build(batch, self.kv_pool.page_size)
        self.sync_scales()

    def init_cuda_graph_state(self, max_bs: int) -> None:
        pool = self.kv_pool
        self.graph = FA3GraphBuffers(max_bs, pool.max_context_len, pool.page_size, pool.device)
        self.graph_meta = {}

    def init_forward_metadata_capture_cuda_graph(self, bs: int, batch: ForwardBatch) -> None:
        assert self.graph is not None, "call init_cuda_graph_state first"
        self.meta = self.graph_meta[bs] = self.graph.fill(bs, batch)
        self.sync_scales()

    def init_forward_metadata_replay_cuda_graph(self, bs: int, batch: ForwardBatch) -> None:
        meta = self.graph.fill(bs, batch)
        captured = self.graph_meta[bs]
        assert meta.page_table.data_ptr() == captured.page_table.data_ptr()
        self.meta = meta
        self.sync_scales()

    def sync_scales(self) -> None:
        pool = self.kv_pool
        if not pool.needs_scale:
            return
        host = [(1.0, k, v) for k, v in zip(pool.k_scale, pool.v_scale)]
        if host != self.scales_host:
            self.scales.copy_(torch.tensor(host, dtype=torch.float32))
            self.scales_host = host

    # -- per layer -----------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        pool, spec, meta = self.kv_pool, self.layers[layer_id], self.meta
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        shape = (-1, pool.page_size, spec.num_kv_heads, spec.head_dim)
        window = (-1, -1) if spec.sliding_window is None else (spec.sliding_window - 1, 0)
        out = self.attn_fn(
            q=q.to(pool.dtype).contiguous(),
            k_cache=pool.k_buffer[layer_id].view(shape),
            v_cache=pool.v_buffer[layer_id].view(shape),
            cache_seqlens=meta.cache_seqlens, page_table=meta.page_table,
            cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q,
            softmax_scale=spec.scaling, causal=True, window_size=window,
            **self.descales(layer_id, meta.cache_seqlens.shape[0], spec.num_kv_heads))
        return out.to(q.dtype)

    def descales(self, layer_id: int, bs: int, kv_heads: int) -> dict:
        if not self.kv_pool.needs_scale:
            return {}
        q, k, v = (self.scales[layer_id, i].expand(bs, kv_heads) for i in range(3))
        return {"q_descale": q, "k_descale": k, "v_descale": v}
