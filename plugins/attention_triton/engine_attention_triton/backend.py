"""Attention backend 'triton': every row of a step (prompt chunks over a cached prefix, decodes)
in one launch of kernels.paged_attention per layer, K/V read in place from the pool.

The per-step metadata is four int64 tensors built on the device from the batch's own tensors
(no host round trip): each request's pool row, the index of its first new token, its new-token
count and its prefix length; plus the largest new-token count, from the batch's host lists.

In a CUDA graph (decode only) the same kernel reads the graph runner's fixed batch: its request
rows and prefix lengths are that batch's own tensors, refilled in place before every replay, and
the first-token indices (0..bs-1) and new-token counts (all 1) never change.
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.interfaces import AttentionBackend, BackendContext

from engine_attention_triton.kernels import paged_attention


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        self.kv_pool = ctx.kv_pool
        self.layers = ctx.layers

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        ext = batch.extend_lens
        self.q_starts = torch.cumsum(ext, 0) - ext
        self.ext_lens = ext
        self.prefix_lens = batch.prefix_lens
        self.req_rows = batch.req_pool_indices
        self.max_ext = max(batch.extend_lens_list)

    def init_cuda_graph_state(self, max_bs: int) -> None:
        dev = self.kv_pool.device
        self.graph_q_starts = torch.arange(max_bs, dtype=torch.int64, device=dev)
        self.graph_ext_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, batch: ForwardBatch) -> None:
        self.q_starts = self.graph_q_starts[:bs]
        self.ext_lens = self.graph_ext_lens[:bs]
        self.prefix_lens = batch.prefix_lens  # the fixed batch's: refilled before each replay
        self.req_rows = batch.req_pool_indices
        self.max_ext = 1

    init_forward_metadata_replay_cuda_graph = init_forward_metadata_capture_cuda_graph

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        pool, spec = self.kv_pool, self.layers[layer_id]
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        paged_attention(q, out, pool.k_buffer[layer_id], pool.v_buffer[layer_id],
                        batch.req_to_token, self.req_rows, self.q_starts, self.ext_lens,
                        self.prefix_lens, self.max_ext, spec.scaling, spec.sliding_window,
                        pool.k_scale[layer_id], pool.v_scale[layer_id])
        return out
