"""Attention backend 'flashinfer': flashinfer's ragged, paged-KV prefill and decode wrappers,
reading the engine's pool in place as NHD paged caches.

Per step one plan() per group of layers that share heads, head dim, scale and sliding window
(the plan fixes all of them); every layer of the group then runs on it. DECODE steps go through
the decode wrapper, which CUDA graphs can capture. Prompt chunks, extends over a cached prefix
and MIXED steps, as SGLang runs them: the new tokens attend to themselves through the ragged
wrapper (causal, K/V straight from the step's k/v tensors) and, where any request has a cached
prefix, to that prefix through the paged wrapper (not causal: the prefix precedes them all);
``merge_state`` joins the two by their log-sum-exps. Layer groups with a sliding window, and
fp8 pools (so that a prompt sees the same quantized K/V that its later steps read, as
torch_native does), run the paged wrapper alone over whole sequences, causal.

On Hopper (compute capability 9.x) the prefill wrappers get flashinfer's FlashAttention-3
kernels (``backend="fa3"``) where they apply, FA2 elsewhere (``--flashinfer-prefill-backend``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.interfaces import AttentionBackend, AttentionLayerSpec, BackendContext
from engine.registry import IncompatibleOptions

from engine_attention_flashinfer.metadata import PagedKV, paged_cache, paged_kv, window_left

MIB = 1 << 20
# the float workspace all wrappers share: SGLang's 384 MiB (its chunked prefills and CUDA-graph
# split-KV decodes fail in flashinfer's recommended 128 MiB); --flashinfer-workspace-size
WORKSPACE_MIB = 384
WORKSPACE_BYTES = WORKSPACE_MIB * MIB
INT_WORKSPACE_BYTES = 8 * MIB  # what every flashinfer wrapper allocates for itself
PREFILL_BACKENDS = ("auto", "fa2", "fa3")
FA3_HEAD_DIMS = (64, 128, 256)  # flashinfer's is_fa3_prefill_head_dim_supported


def flashinfer_ops() -> SimpleNamespace:
    import flashinfer
    from flashinfer.cascade import merge_state

    return SimpleNamespace(prefill_wrapper=flashinfer.BatchPrefillWithPagedKVCacheWrapper,
                           ragged_wrapper=flashinfer.BatchPrefillWithRaggedKVCacheWrapper,
                           decode_wrapper=flashinfer.BatchDecodeWithPagedKVCacheWrapper,
                           merge_state=merge_state)


def require_half(name: str, ctx: BackendContext) -> None:
    if ctx.dtype not in (torch.float16, torch.bfloat16):
        raise IncompatibleOptions(
            f"attention backend '{name}' runs float16 or bfloat16 models, not "
            f"{str(ctx.dtype).removeprefix('torch.')}: pass --dtype bfloat16 (or float16).")


def sm90a_supported(device) -> bool:
    """flashinfer's own test for its FA3 kernels (is_sm90a_supported: Hopper, CUDA >= 12.3)."""
    try:
        from flashinfer.utils import is_sm90a_supported
    except ImportError:
        return False
    return bool(is_sm90a_supported(torch.device(device)))


def choose_prefill_backend(requested: str, capability, q_dtype, kv_dtype, head_dims,
                           sm90a: bool) -> str:
    """The prefill wrappers' ``backend``: "fa3" (flashinfer's FlashAttention-3 kernels) on a
    Hopper GPU where flashinfer builds them (``sm90a``) for these dtypes and head dims, "fa2"
    elsewhere; ``requested`` "fa2"/"fa3" forces one (fa3 where it cannot run is refused)."""
    if requested not in PREFILL_BACKENDS:
        raise IncompatibleOptions(f"--flashinfer-prefill-backend must be one of "
                                  f"{', '.join(PREFILL_BACKENDS)}, got {requested!r}.")
    why = None
    if not (capability and capability[0] == 9 and sm90a):
        why = "needs a Hopper GPU (compute capability 9.x) and a CUDA >= 12.3 build of torch"
    elif kv_dtype != q_dtype:  # FA3's fp8 K/V want fp8 queries (is_fa3_backend_supported)
        why = f"runs K/V in the queries' dtype, and the KV cache is {kv_dtype}"
    elif any(d not in FA3_HEAD_DIMS for d in head_dims):
        why = f"takes head dims {FA3_HEAD_DIMS}, found {sorted(set(head_dims))}"
    if requested == "fa3" and why:
        raise IncompatibleOptions(f"--flashinfer-prefill-backend fa3: flashinfer's FA3 kernels "
                                  f"{why}; use auto or fa2.")
    if requested == "auto":
        return "fa2" if why else "fa3"
    return requested


def from_context(ctx: BackendContext) -> "FlashInferBackend":
    require_half("flashinfer", ctx)
    options = ctx.options or {}
    dev = torch.device(ctx.device)
    capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    backend = choose_prefill_backend(
        options.get("flashinfer_prefill_backend") or "auto", capability, ctx.dtype,
        ctx.kv_pool.dtype, [s.head_dim for s in ctx.layers],
        capability is not None and sm90a_supported(dev))
    mib = options.get("flashinfer_workspace_size") or WORKSPACE_MIB
    return FlashInferBackend(ctx, workspace_bytes=int(mib) * MIB, prefill_backend=backend)


def plan_key(spec: AttentionLayerSpec) -> tuple:
    return (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scaling, spec.sliding_window)


def graph_memory_bytes(max_bs: int, num_sizes: int, layers, page_size: int,
                       max_context_len: int, options: dict | None = None) -> int:
    """Device memory the backend adds outside the KV pool, for the CUDA-graph reservation: the
    shared float workspace, the 8 MiB int workspace of each eager wrapper (prefill, ragged,
    decode per layer group) and of each captured size's decode wrapper per group, and the
    fixed index buffers the graphs read."""
    groups = len({plan_key(s) for s in layers})
    mib = (options or {}).get("flashinfer_workspace_size") or WORKSPACE_MIB
    max_pages = -(-max_context_len // page_size)
    index_buffers = 4 * ((max_bs + 1) + max_bs * max_pages + max_bs)
    return (int(mib) * MIB + INT_WORKSPACE_BYTES * groups * (3 + num_sizes) + index_buffers)


class FlashInferBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, ctx: BackendContext, ops=None, workspace_bytes: int = WORKSPACE_BYTES,
                 prefill_backend: str = "auto", ragged: bool = True):
        """``prefill_backend``: the prefill wrappers' flashinfer backend ("auto", "fa2",
        "fa3"); ``ragged``: run prompt tokens through the ragged wrapper (see above)."""
        super().__init__(ctx)
        self.ops = ops if ops is not None else flashinfer_ops()
        self.pool, self.layers = ctx.kv_pool, ctx.layers
        self.keys = [plan_key(s) for s in ctx.layers]
        self.specs = dict(zip(self.keys, ctx.layers))
        self.prefill_backend = prefill_backend
        # one zeroed workspace for every wrapper: their kernels run one after another
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=ctx.device)
        self.prefill = {key: self.ops.prefill_wrapper(self.workspace, kv_layout="NHD",
                                                      backend=prefill_backend)
                        for key in self.specs}
        # the ragged path: layer groups without a window, pools in the model's dtype
        use_ragged = ragged and not self.pool.needs_scale and self.pool.dtype == ctx.dtype
        self.ragged = {key: self.ops.ragged_wrapper(self.workspace, kv_layout="NHD",
                                                    backend=prefill_backend)
                       for key, spec in self.specs.items()
                       if use_ragged and spec.sliding_window is None}
        self.decode = {key: self.decode_wrapper(spec) for key, spec in self.specs.items()}
        self.active: dict = {}  # plan key -> the wrapper planned for this step
        self.ragged_active: dict = {}  # plan key -> the ragged wrapper planned for this step
        self.with_prefix = False  # whether this step's ragged layers merge a cached prefix
        self.graph_wrappers: dict[int, dict] = {}

    def decode_wrapper(self, spec: AttentionLayerSpec, **graph_buffers):
        # tensor cores pay off from 4 query heads per KV head, and for fp8 K/V
        tensor_cores = spec.num_heads // spec.num_kv_heads >= 4 or self.pool.dtype.itemsize == 1
        return self.ops.decode_wrapper(self.workspace, kv_layout="NHD",
                                       use_tensor_cores=tensor_cores, **graph_buffers)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        ps = self.pool.page_size
        if batch.mode == ForwardMode.DECODE:
            self.plan_decode(self.decode, paged_kv(batch, ps))
            return
        plans = dict(q_data_type=self.ctx.dtype, kv_data_type=self.pool.dtype)
        self.ragged_active = self.ragged
        if self.ragged:
            qo = paged_kv(batch, ps, prefix_only=True)
            self.with_prefix = any(batch.prefix_lens_list)
            for key, wrapper in self.ragged.items():
                spec = self.specs[key]
                # every request's new tokens against themselves: kv offsets = query offsets
                wrapper.plan(qo.qo_indptr, qo.qo_indptr, spec.num_heads, spec.num_kv_heads,
                             spec.head_dim, causal=True, sm_scale=spec.scaling, window_left=-1,
                             **plans)
                if self.with_prefix:  # and against the cached prefix (none: 0 pages)
                    self.prefill[key].plan(
                        qo.qo_indptr, qo.kv_indptr, qo.kv_indices, qo.kv_last_page_len,
                        spec.num_heads, spec.num_kv_heads, spec.head_dim, ps, causal=False,
                        sm_scale=spec.scaling, window_left=-1, **plans)
        paged = [key for key in self.specs if key not in self.ragged]
        if paged:
            meta = paged_kv(batch, ps)
            for key in paged:
                spec = self.specs[key]
                self.prefill[key].plan(
                    meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                    spec.num_heads, spec.num_kv_heads, spec.head_dim, ps, causal=True,
                    sm_scale=spec.scaling, window_left=window_left(spec.sliding_window),
                    **plans)
        self.active = self.prefill

    def plan_decode(self, wrappers: dict, meta: PagedKV) -> None:
        for key, wrapper in wrappers.items():
            spec = self.specs[key]
            wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                         spec.num_heads, spec.num_kv_heads, spec.head_dim, self.pool.page_size,
                         window_left=window_left(spec.sliding_window), sm_scale=spec.scaling,
                         q_data_type=self.ctx.dtype, kv_data_type=self.pool.dtype)
        self.active = wrappers
        self.ragged_active = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        pool = self.pool
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        key = self.keys[layer_id]
        q = q.contiguous()
        ragged = self.ragged_active.get(key)
        if ragged is not None:
            out, lse = ragged.run(q, k.contiguous(), v.contiguous(), return_lse=True)
            if not self.with_prefix:
                return out
            prefix_out, prefix_lse = self.active[key].run(q, paged_cache(pool, layer_id),
                                                          return_lse=True)
            return self.ops.merge_state(out, lse, prefix_out, prefix_lse)[0]
        scales = {}
        if pool.needs_scale:  # the kernel folds k_scale into the softmax scale, v_scale into out
            scales = dict(k_scale=float(pool.k_scale[layer_id]),
                          v_scale=float(pool.v_scale[layer_id]))
        return self.active[key].run(q, paged_cache(pool, layer_id), **scales)

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
