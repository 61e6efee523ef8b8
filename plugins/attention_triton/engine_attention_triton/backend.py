"""Attention backend 'triton': every row of a step (prompt chunks over a cached prefix, decodes)
in one launch of kernels.paged_attention per layer, K/V read in place from the pool.

The per-step metadata is four int64 tensors built on the device from the batch's own tensors
(no host round trip): each request's pool row, the index of its first new token, its new-token
count and its prefix length; plus the largest new-token count, from the batch's host lists.

In a CUDA graph (decode only) the same kernel reads the graph runner's fixed batch: its request
rows and prefix lengths are that batch's own tensors, refilled in place before every replay, and
the first-token indices (0..bs-1) and new-token counts (all 1) never change.

Decode steps (every request one token) split each request's keys over ``num_kv_splits``
programs when the batch alone would leave SMs idle (kernels.num_kv_splits: from the batch size
and the GPU's SM count; ``sm_count`` is a parameter where there is no GPU). The count depends
on the batch size only inside a CUDA graph, so a captured size keeps its grid.

An MLA layer (``forward_latent``: DeepSeek's latent rows, one KV head) runs the same kernel as
multi-query attention with the pool's row buffer as both K and V: each head's output is then
the weighted sum of whole rows, of which the first ``kv_lora_rank`` values are the MLA output
(the rope key's few columns are computed and dropped: qk_rope_head_dim / (kv_lora_rank +
qk_rope_head_dim) of the value work, 1/9 for DeepSeek-V3). Prompt chunks and decode steps
alike, absorbed; the split-KV decode too.
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.interfaces import AttentionBackend, BackendContext

from engine_attention_triton.geometry import num_kv_splits
from engine_attention_triton.kernels import paged_attention


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, ctx: BackendContext, num_kv_splits: int | None = None,
                 sm_count: int | None = None):
        """``num_kv_splits``: force the decode split count (None: chosen per step);
        ``sm_count``: the GPU's SM count (None: the device's, 1 without a GPU)."""
        super().__init__(ctx)
        self.kv_pool = ctx.kv_pool
        self.layers = ctx.layers
        self.forced_splits = num_kv_splits
        if sm_count is None:
            dev = torch.device(ctx.kv_pool.device)
            sm_count = (torch.cuda.get_device_properties(dev).multi_processor_count
                        if dev.type == "cuda" else 1)
        self.sm_count = sm_count
        self.max_seq_len: int | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        ext = batch.extend_lens
        self.q_starts = torch.cumsum(ext, 0) - ext
        self.ext_lens = ext
        self.prefix_lens = batch.prefix_lens
        self.req_rows = batch.req_pool_indices
        self.max_ext = max(batch.extend_lens_list)
        self.max_seq_len = max(batch.seq_lens_list)

    def splits(self, layer_id: int) -> int:
        """The decode step's split count for this layer's heads (1 for other steps)."""
        if self.max_ext != 1:
            return 1
        if self.forced_splits is not None:
            return self.forced_splits
        spec = self.layers[layer_id]
        return num_kv_splits(self.ext_lens.shape[0], spec.num_kv_heads,
                             spec.num_heads // spec.num_kv_heads, self.sm_count,
                             self.max_seq_len)

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
        self.max_seq_len = None  # the grid must serve every replay's lengths

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
                        pool.k_scale[layer_id], pool.v_scale[layer_id], self.splits(layer_id))
        return out

    def forward_latent(self, q: torch.Tensor, latent: torch.Tensor, layer_id: int,
                       batch: ForwardBatch) -> torch.Tensor:
        pool, spec = self.kv_pool, self.layers[layer_id]
        pool.set_latent(layer_id, batch.out_cache_loc, latent)
        q = q.contiguous()
        out = torch.empty_like(q)
        rows, scale = pool.k_buffer[layer_id], pool.k_scale[layer_id]
        paged_attention(q, out, rows, rows, batch.req_to_token, self.req_rows, self.q_starts,
                        self.ext_lens, self.prefix_lens, self.max_ext, spec.scaling, None,
                        scale, scale, self.splits(layer_id))
        return out[..., :spec.kv_lora_rank]
