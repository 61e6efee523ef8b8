"""Attention backend 'trtllm_mha': the TensorRT-LLM attention kernels shipped in flashinfer
(Blackwell), reading the engine's pool in place.

DECODE steps call trtllm_batch_decode_with_kv_cache; prompt chunks, extends over a cached prefix
and MIXED steps call trtllm_batch_context_with_kv_cache with per-request query and key offsets
(a request's queries are the last of its keys: bottom-right causal). Both take the pool's NHD
pages with kv_layout="NHD", which they read through a transposed (HND) view: no copy, no
re-layout of the pool. No plan step: the metadata is one block table per step.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.interfaces import AttentionBackend, BackendContext
from engine.registry import IncompatibleOptions

from engine_attention_flashinfer.flashinfer_backend import require_half
from engine_attention_flashinfer.limits import TRTLLM_PAGE_SIZES as PAGE_SIZES  # KV tiles
from engine_attention_flashinfer.metadata import (BlockTables, block_tables, page_table,
                                                  paged_cache, window_left)

# counters, then multi-CTA partial results (which grow with batch x heads): SGLang's default
WORKSPACE_BYTES = 512 << 20


def trtllm_ops() -> SimpleNamespace:
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache
    from flashinfer.prefill import trtllm_batch_context_with_kv_cache

    return SimpleNamespace(decode=trtllm_batch_decode_with_kv_cache,
                           context=trtllm_batch_context_with_kv_cache)


def graph_memory_bytes(max_bs: int, num_sizes: int, layers, page_size: int,
                       max_context_len: int, options: dict | None = None) -> int:
    """Device memory the backend adds outside the KV pool, for the CUDA-graph reservation: its
    workspace and the graphs' fixed block tables and sequence lengths (one set for all sizes)."""
    width = -(-max_context_len // page_size)
    return WORKSPACE_BYTES + 4 * (max_bs * width + max_bs)


def from_context(ctx: BackendContext) -> "TrtllmMhaBackend":
    require_half("trtllm_mha", ctx)
    if ctx.kv_pool.page_size not in PAGE_SIZES:  # the engine resolves it; a direct caller may not
        raise IncompatibleOptions(
            f"attention backend 'trtllm_mha' needs --page-size 16, 32 or 64 (its kernels' KV "
            f"tiles), got {ctx.kv_pool.page_size}.")
    return TrtllmMhaBackend(ctx)


class TrtllmMhaBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, ctx: BackendContext, ops=None, workspace_bytes: int = WORKSPACE_BYTES):
        super().__init__(ctx)
        self.ops = ops if ops is not None else trtllm_ops()
        self.pool, self.layers = ctx.kv_pool, ctx.layers
        assert self.pool.dtype.itemsize > 1 or self.pool.dtype == torch.float8_e4m3fn, \
            "the TensorRT-LLM kernels take fp8 K/V as float8_e4m3fn only"
        # the kernels keep counters in it between launches: it must start zeroed
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=ctx.device)
        self.meta: BlockTables | None = None
        self.graph_meta: dict[int, BlockTables] = {}

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.meta = block_tables(batch, self.pool.page_size)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        pool, spec, m = self.pool, self.layers[layer_id], self.meta
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_scale = float(pool.k_scale[layer_id]) if pool.needs_scale else 1.0
        v_scale = float(pool.v_scale[layer_id]) if pool.needs_scale else 1.0
        common = dict(kv_cache=paged_cache(pool, layer_id, read_as_hnd=True),
                      workspace_buffer=self.workspace, block_tables=m.block_tables,
                      seq_lens=m.seq_lens, bmm1_scale=spec.scaling * k_scale, bmm2_scale=v_scale,
                      window_left=window_left(spec.sliding_window), out_dtype=q.dtype,
                      kv_layout="NHD")
        if m.cum_seq_lens_q is None:  # DECODE: one query per request
            return self.ops.decode(query=q.contiguous(), max_seq_len=m.max_kv_len, **common)
        query = q.contiguous()
        if pool.needs_scale:
            # the context kernels pair fp8 K/V with fp8 queries only (scale 1: q is already in
            # range); saturate as the pool does rather than overflow to NaN
            fmax = torch.finfo(pool.dtype).max
            query = query.clamp(-fmax, fmax).to(pool.dtype)
        return self.ops.context(query=query, max_q_len=m.max_q_len, max_kv_len=m.max_kv_len,
                                batch_size=batch.batch_size, cum_seq_lens_q=m.cum_seq_lens_q,
                                cum_seq_lens_kv=m.cum_seq_lens_kv, **common)

    # -- CUDA graphs: block tables and lengths in fixed buffers, refilled in place ------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        pool, dev = self.pool, self.workspace.device
        width = -(-pool.max_context_len // pool.page_size)
        self.graph_tables = torch.zeros(max_bs, width, dtype=torch.int32, device=dev)
        self.graph_seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.graph_meta = {}

    def init_forward_metadata_capture_cuda_graph(self, bs: int, batch: ForwardBatch) -> None:
        assert batch.mode == ForwardMode.DECODE and batch.batch_size == bs
        # the longest context bounds every replay's sequences (a launch parameter the graph keeps)
        self.graph_meta[bs] = BlockTables(self.graph_tables[:bs], self.graph_seq_lens[:bs],
                                          None, None, 1, self.pool.max_context_len)
        self.init_forward_metadata_replay_cuda_graph(bs, batch)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, batch: ForwardBatch) -> None:
        ps = self.pool.page_size
        width = -(-max(batch.seq_lens_list) // ps)
        self.graph_tables[:bs, :width].copy_(page_table(batch, ps, width))
        self.graph_tables[:bs, width:].zero_()
        self.graph_seq_lens[:bs].copy_(batch.seq_lens)
        self.meta = self.graph_meta[bs]
