"""Multi-head latent attention (DeepSeek-V2/V3's MLA, ``AttentionBackend.forward_latent``)
through flashinfer: the 'flashinfer' backend for an MLA model, and 'trtllm_mla' (Blackwell).

The engine's MLA pool holds one row per token and layer, the compressed latent (the first
``kv_lora_rank`` values) then the rotated rope key; queries come absorbed (W_UK folded in), as
wide as the rows, and the output is ``kv_lora_rank`` wide per head.

- ``flashinfer``: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` for every step: one
  ``plan()`` per step (qo_indptr, the pages of each whole sequence, each sequence's length,
  heads, ``head_dim_ckv`` = kv_lora_rank, ``head_dim_kpe`` = the rope dims, page size, causal
  for prompts and extends (bottom-right: the cached prefix precedes the new tokens), the
  layer's softmax scale), then per layer ``run(q_nope, q_pe, ckv_cache, kpe_cache)`` with the
  caches as views of the pool's rows [pages + 1, page_size, ...] (page 0 the scratch page), as
  SGLang's FlashInferMLAAttnBackend passes them.
- ``trtllm_mla``: DECODE steps through ``trtllm_batch_decode_with_kv_cache_mla`` (TensorRT-LLM's
  trtllm-gen kernels: query [B, 1, H, kv_lora_rank + rope], the pool viewed [pages + 1, 1,
  page_size, kv_lora_rank + rope], a block table, ``bmm1_scale`` the layer's scale times the K
  scale, ``bmm2_scale`` the V scale), everything else through the MLA wrapper above, as SGLang's
  TRTLLMMLABackend builds on its flashinfer MLA backend.

Both read latent caches in the model's dtype (bfloat16 / float16; an fp8 pool is refused with
the backends that take one), and flashinfer's MLA kernels are built for DeepSeek's sizes
(kv_lora_rank 512, rope 64): other sizes are refused where the real kernels would run.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.interfaces import AttentionBackend, BackendContext
from engine.registry import IncompatibleOptions

from engine_attention_flashinfer.limits import TRTLLM_MLA_PAGE_SIZES
from engine_attention_flashinfer.metadata import block_tables, paged_kv

MIB = 1 << 20
MLA_WORKSPACE_BYTES = 384 * MIB  # SGLang's flashinfer workspace
TRTLLM_MLA_WORKSPACE_BYTES = 512 * MIB  # SGLang's trtllm_mla workspace
KERNEL_DIMS = (512, 64)  # (kv_lora_rank, rope) the kernels are built for: DeepSeek-V2/V3's


def mla_ops() -> SimpleNamespace:
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    return SimpleNamespace(mla_wrapper=BatchMLAPagedAttentionWrapper)


def trtllm_mla_ops() -> SimpleNamespace:
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

    return SimpleNamespace(**vars(mla_ops()), mla_decode=trtllm_batch_decode_with_kv_cache_mla)


def is_mla(ctx: BackendContext) -> bool:
    return any(s.kv_lora_rank for s in ctx.layers)


def check_context(name: str, ctx: BackendContext, real_kernels: bool) -> None:
    """Refuse what the MLA kernels cannot run, with the reason."""
    if ctx.dtype not in (torch.float16, torch.bfloat16):
        raise IncompatibleOptions(
            f"attention backend '{name}' runs float16 or bfloat16 models, not "
            f"{str(ctx.dtype).removeprefix('torch.')}: pass --dtype bfloat16 (or float16).")
    if ctx.kv_pool.dtype != ctx.dtype:
        raise IncompatibleOptions(
            f"attention backend '{name}' reads MLA latent caches in the model's dtype, and the "
            f"pool is {str(ctx.kv_pool.dtype).removeprefix('torch.')}: use --kv-cache-dtype "
            f"auto, or --attention-backend triton / torch_native for an fp8 latent cache.")
    dims = {(s.kv_lora_rank, s.head_dim - s.kv_lora_rank) for s in ctx.layers}
    if real_kernels and dims != {KERNEL_DIMS}:
        raise IncompatibleOptions(
            f"attention backend '{name}': flashinfer's MLA kernels are built for kv_lora_rank "
            f"{KERNEL_DIMS[0]} and qk_rope_head_dim {KERNEL_DIMS[1]} (DeepSeek-V2/V3), and this "
            f"model has {sorted(dims)}; use --attention-backend triton.")


def from_context(ctx: BackendContext) -> "FlashInferMLABackend":
    check_context("flashinfer", ctx, real_kernels=True)
    return FlashInferMLABackend(ctx)


def trtllm_from_context(ctx: BackendContext) -> "TrtllmMLABackend":
    if not is_mla(ctx):
        raise IncompatibleOptions(
            "attention backend 'trtllm_mla' attends multi-head latent attention (DeepSeek-V2/"
            "V3) only; use trtllm_mha for this model.")
    check_context("trtllm_mla", ctx, real_kernels=True)
    if ctx.kv_pool.page_size not in TRTLLM_MLA_PAGE_SIZES:
        raise IncompatibleOptions(
            f"attention backend 'trtllm_mla' needs --page-size "
            f"{' or '.join(map(str, TRTLLM_MLA_PAGE_SIZES))}, got {ctx.kv_pool.page_size}.")
    return TrtllmMLABackend(ctx)


class FlashInferMLABackend(AttentionBackend):
    supports_cuda_graph = False  # the MLA models refuse CUDA graphs (their MoE layers)

    def __init__(self, ctx: BackendContext, ops=None, workspace_bytes: int = MLA_WORKSPACE_BYTES):
        super().__init__(ctx)
        self.ops = ops if ops is not None else self.default_ops()
        self.pool, self.layers = ctx.kv_pool, ctx.layers
        specs = {(s.num_heads, s.head_dim, s.kv_lora_rank, s.scaling) for s in ctx.layers}
        if len(specs) != 1 or not ctx.layers[0].kv_lora_rank:
            raise IncompatibleOptions(f"the flashinfer MLA backend needs every layer latent "
                                      f"with one shape and scale, got {sorted(specs)}")
        self.heads, self.dim, self.lora, self.scaling = specs.pop()
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=ctx.device)
        self.wrapper = self.ops.mla_wrapper(self.workspace, backend="auto")

    @staticmethod
    def default_ops() -> SimpleNamespace:
        return mla_ops()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # the indptrs and lengths on the host, as the MHA backend's: plan() splits the work
        # there and copies them to the device itself
        meta = paged_kv(batch, self.pool.page_size)
        kv_len = torch.tensor(batch.seq_lens_list, dtype=torch.int32)
        self.wrapper.plan(
            meta.qo_indptr, meta.kv_indptr, meta.kv_indices, kv_len, self.heads, self.lora,
            self.dim - self.lora,
            self.pool.page_size, batch.mode != ForwardMode.DECODE, self.scaling,
            self.ctx.dtype, self.pool.dtype)

    def caches(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ckv [pages + 1, page_size, kv_lora_rank], kpe [..., rope]): views of the rows."""
        rows = self.pool.k_buffer[layer_id]  # [slots, 1, dim]
        paged = rows.view(-1, self.pool.page_size, self.dim)
        return paged[..., :self.lora], paged[..., self.lora:]

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch):
        raise IncompatibleOptions("the flashinfer MLA backend attends latent rows only "
                                  "(forward_latent)")

    def forward_latent(self, q: torch.Tensor, latent: torch.Tensor, layer_id: int,
                       batch: ForwardBatch) -> torch.Tensor:
        self.pool.set_latent(layer_id, batch.out_cache_loc, latent)
        q = q.contiguous()
        ckv, kpe = self.caches(layer_id)
        return self.wrapper.run(q[..., :self.lora], q[..., self.lora:], ckv, kpe)


class TrtllmMLABackend(FlashInferMLABackend):
    def __init__(self, ctx: BackendContext, ops=None,
                 workspace_bytes: int = TRTLLM_MLA_WORKSPACE_BYTES):
        super().__init__(ctx, ops, workspace_bytes)
        self.nope = ctx.layers[0].qk_nope_head_dim
        self.tables = None

    @staticmethod
    def default_ops() -> SimpleNamespace:
        return trtllm_mla_ops()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.DECODE:
            self.tables = block_tables(batch, self.pool.page_size)
            return
        self.tables = None
        super().init_forward_metadata(batch)

    def forward_latent(self, q: torch.Tensor, latent: torch.Tensor, layer_id: int,
                       batch: ForwardBatch) -> torch.Tensor:
        if self.tables is None:
            return super().forward_latent(q, latent, layer_id, batch)
        pool, t = self.pool, self.tables
        pool.set_latent(layer_id, batch.out_cache_loc, latent)
        B = batch.batch_size
        kv_cache = pool.k_buffer[layer_id].view(-1, 1, pool.page_size, self.dim)
        # unscaled caches only (check_context refuses fp8 ones): bmm2_scale 1
        out = self.ops.mla_decode(
            query=q.contiguous().view(B, 1, self.heads, self.dim), kv_cache=kv_cache,
            workspace_buffer=self.workspace, qk_nope_head_dim=self.nope,
            kv_lora_rank=self.lora, qk_rope_head_dim=self.dim - self.lora,
            block_tables=t.block_tables, seq_lens=t.seq_lens, max_seq_len=t.max_kv_len,
            bmm1_scale=self.scaling, bmm2_scale=1.0)
        return out.view(B, self.heads, self.lora)
