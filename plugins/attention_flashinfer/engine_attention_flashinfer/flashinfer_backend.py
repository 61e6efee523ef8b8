"""Attention backend 'flashinfer': flashinfer's paged-KV prefill and decode wrappers, reading the
engine's pool in place as NHD paged caches.

Per step one plan() per group of layers that share heads, head dim, scale and sliding window
(the plan fixes all of them); every layer of the group then runs on it. Prompt chunks, extends
over a cached prefix and MIXED steps go through the prefill wrapper (causal, bottom-right);
DECODE steps through the decode wrapper, which CUDA graphs can capture.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.interfaces import AttentionBackend, AttentionLayerSpec, BackendContext
from engine.registry import IncompatibleOptions

from engine_attention_flashinfer.metadata import PagedKV, paged_cache, paged_kv, window_left

WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended float workspace


def flashinfer_ops() -> SimpleNamespace:
    import flashinfer

    return SimpleNamespace(prefill_wrapper=flashinfer.BatchPrefillWithPagedKVCacheWrapper,
                           decode_wrapper=flashinfer.BatchDecodeWithPagedKVCacheWrapper)


def require_half(name: str, ctx: BackendContext) -> None:
    if ctx.dtype not in (torch.float16, torch.bfloat16):
        raise IncompatibleOptions(
            f"attention backend '{name}' runs float16 or bfloat16 models, not "
            f"{str(ctx.dtype).removeprefix('torch.')}: pass --dtype bfloat16 (or float16).")


def from_context(ctx: BackendContext) -> "FlashInferBackend":
    require_half("flashinfer", ctx)
    return FlashInferBackend(ctx)


def plan_key(spec: AttentionLayerSpec) -> tuple:
    return (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scaling, spec.sliding_window)


class FlashInferBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, ctx: BackendContext, ops=None, workspace_bytes: int = WORKSPACE_BYTES):
        super().__init__(ctx)
        self.ops = ops if ops is not None else flashinfer_ops()
        self.pool, self.layers = ctx.kv_pool, ctx.layers
        self.keys = [plan_key(s) for s in ctx.layers]
        self.specs = dict(zip(self.keys, ctx.layers))
        # one zeroed workspace for every wrapper: their kernels run one after another
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=ctx.device)
        self.prefill = {key: self.ops.prefill_wrapper(self.workspace, kv_layout="NHD")
                        for key in self.specs}
        self.decode = {key: self.decode_wrapper(spec) for key, spec in self.specs.items()}
        self.active: dict = {}  # plan key -> the wrapper planned for this step
        self.graph_wrappers: dict[int, dict] = {}

    def decode_wrapper(self, spec: AttentionLayerSpec, **graph_buffers):
        # tensor cores pay off from 4 query heads per KV head, and for fp8 K/V
        tensor_cores = spec.num_heads // spec.num_kv_heads >= 4 or self.pool.dtype.itemsize == 1
        return self.ops.decode_wrapper(self.workspace, kv_layout="NHD",
                                       use_tensor_cores=tensor_cores, **graph_buffers)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        meta = paged_kv(batch, self.pool.page_size)
        if batch.mode == ForwardMode.DECODE:
            self.plan_decode(self.decode, meta)
            return
        for key, wrapper in self.prefill.items():
            spec = self.specs[key]
            wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                         spec.num_heads, spec.num_kv_heads, spec.head_dim, self.pool.page_size,
                         causal=True, sm_scale=spec.scaling,
                         window_left=window_left(spec.sliding_window),
                         q_data_type=self.ctx.dtype, kv_data_type=self.pool.dtype)
        self.active = self.prefill

    def plan_decode(self, wrappers: dict, meta: PagedKV) -> None:
        for key, wrapper in wrappers.items():
            spec = self.specs[key]
            wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                         spec.num_heads, spec.num_kv_heads, spec.head_dim, self.pool.page_size,
                         window_left=window_left(spec.sliding_window), sm_scale=spec.scaling,
                         q_data_type=self.ctx.dtype, kv_data_type=self.pool.dtype)
        self.active = wrappers

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        pool = self.pool
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        scales = {}
        if pool.needs_scale:  # the kernel folds k_scale into the softmax scale, v_scale into out
            scales = dict(k_scale=float(pool.k_scale[layer_id]),
                          v_scale=float(pool.v_scale[layer_id]))
        wrapper = self.active[self.keys[layer_id]]
        return wrapper.run(q.contiguous(), paged_cache(pool, layer_id), **scales)

    # -- CUDA graphs: decode wrappers over fixed buffers, planned again before each replay ----
    def init_cuda_graph_state(self, max_bs: int) -> None:
        pool, dev = self.pool, self.workspace.device
        max_pages = -(-pool.max_context_len // pool.page_size)
        self.graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.graph_indices = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=dev)
        self.graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.graph_wrappers = {}

    def init_forward_metadata_capture_cuda_graph(self, bs: int, batch: ForwardBatch) -> None:
        assert batch.mode == ForwardMode.DECODE and batch.batch_size == bs
        # one wrapper per (size, plan key): a graph wrapper's batch size is fixed; all of them
        # share the buffers, since one graph replays at a time
        self.graph_wrappers[bs] = {key: self.decode_wrapper(
            spec, use_cuda_graph=True, paged_kv_indptr_buffer=self.graph_indptr[:bs + 1],
            paged_kv_indices_buffer=self.graph_indices,
            paged_kv_last_page_len_buffer=self.graph_last_page_len[:bs])
            for key, spec in self.specs.items()}
        self.init_forward_metadata_replay_cuda_graph(bs, batch)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, batch: ForwardBatch) -> None:
        # plan() copies the step's metadata into the fixed buffers the graph's kernels read
        self.plan_decode(self.graph_wrappers[bs], paged_kv(batch, self.pool.page_size))
