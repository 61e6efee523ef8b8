"""Attention backend 'cpu': decode rows and prompt chunks through C kernels.

A decode step reads every running request's K/V once. The kernel reads them straight from the
pool through ``req_to_token``; torch_native first gathers them into a padded copy, which on a CPU
costs more memory traffic (and page faults) than the attention itself. Rows that bring several
tokens (prompt chunks, maybe after a cached prefix) go through the prompt kernel
(prompt_attention.c: tiles of queries against blocks of keys read from the pool, causal per
row) where every layer's head dim is a multiple of 16 up to 128; otherwise, and with
``ENGINE_PROMPT_ATTENTION=sdpa``, through torch_native's SDPA groups.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from engine.attention.torch_native import TorchNativeBackend, bucket_prompts, split_rows
from engine.forward_batch import ForwardBatch

from engine_attention_cpu.kernel import (DTYPES, KernelUnavailable, decode_attention, load,
                                         load_prompt, prompt_attention, prompt_shape_ok)

PROMPT_ENV = "ENGINE_PROMPT_ATTENTION"  # "sdpa": prompt rows through torch SDPA, as before
log = logging.getLogger("engine")


class CPUBackend(TorchNativeBackend):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.prompt_kernel = self._prompt_kernel()
        self.prompts = None

    def _prompt_kernel(self) -> bool:
        """Whether prompt rows go through prompt_attention.c (said in the log when not)."""
        if os.environ.get(PROMPT_ENV, "kernel") == "sdpa":
            return False
        for layer_id, spec in enumerate(self.layers):
            if spec.kv_lora_rank or not prompt_shape_ok(spec.num_heads, spec.num_kv_heads,
                                                         spec.head_dim):
                log.info("attention backend cpu: prompt chunks run torch SDPA (the prompt "
                         "kernel takes head dims that are multiples of 16 up to 128 and no "
                         "latent attention; layer %d has %d heads of %d, %d KV heads)",
                         layer_id, spec.num_heads, spec.head_dim, spec.num_kv_heads)
                return False
        try:
            load_prompt()
        except KernelUnavailable as e:
            log.warning("attention backend cpu: prompt chunks run torch SDPA: %s", e)
            return False
        return True

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        single, multi = split_rows(batch)
        self.prompts = None
        if multi and self.prompt_kernel:
            # per request bringing several tokens: (its first row in the batch, its new
            # tokens, its cached prefix, its req_to_token row)
            ext = np.asarray(batch.extend_lens_list, dtype=np.int64)
            starts = np.cumsum(ext) - ext
            idx = np.asarray(multi, dtype=np.int64)
            self.prompts = (torch.from_numpy(starts[idx]), torch.from_numpy(ext[idx]),
                            torch.from_numpy(np.asarray(batch.prefix_lens_list,
                                                        dtype=np.int64)[idx]),
                            batch.req_pool_indices[torch.from_numpy(idx)].contiguous())
            self.groups = []
        else:
            self.groups = [self.make_group(batch, idx) for idx in bucket_prompts(batch, multi)]
        self.decode = None
        if len(single) == batch.batch_size:  # a decode step: every row, in order
            self.decode = (batch.logits_indices.contiguous(),
                           batch.req_pool_indices.contiguous(), batch.seq_lens.contiguous())
        elif single:
            sel = torch.from_numpy(np.array(single, dtype=np.int64))
            # (the row's one token in the batch, its req_to_token row, its length)
            self.decode = (batch.logits_indices[sel].contiguous(),
                           batch.req_pool_indices[sel].contiguous(),
                           batch.seq_lens[sel].contiguous())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        if self.decode is None and self.prompts is None:  # torch_native's path as it is
            return super().forward(q, k, v, layer_id, batch)
        pool, spec = self.kv_pool, self.layers[layer_id]
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        out = torch.empty(q.shape, dtype=torch.float32)
        kbuf, vbuf = pool.k_buffer[layer_id], pool.v_buffer[layer_id]
        scales = (pool.k_scale[layer_id], pool.v_scale[layer_id])
        if self.decode is not None:
            tokens, rows, seq_lens = self.decode
            decode_attention(q.float().contiguous(), out, tokens, kbuf, vbuf, pool.req_to_token,
                             rows, seq_lens, spec.sliding_window, spec.scaling, *scales)
        if self.prompts is not None:
            qf = q.float()
            if qf.stride(2) != 1 or qf.stride(1) != qf.shape[2]:
                qf = qf.contiguous()
            prompt_attention(qf, out, *self.prompts, kbuf, vbuf, pool.req_to_token,
                             spec.sliding_window, spec.scaling, *scales)
        self.attend_groups(q, layer_id, out)
        return out.to(q.dtype)

    def cpu_graph_nodes(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, max_rows: int) -> list:
        """Three CPU-graph nodes per layer (engine.cpu_graph): every row's K and V stored at
        its slot as ``KVDtype.store`` stores them (a cast, or scaled and clamped); then the
        kernel's attention of each row over the first ``seq_lens[row]`` slots of its request
        (a request may have several rows: one per token, each with its own length); then the
        merge of the rows whose keys were split between threads. Every layer's nodes share
        one scratch for the split."""
        import ctypes

        from engine.cpu_graph import CArgs, GraphNode, GraphUnsupported
        from engine.interfaces import KVDtype

        pool, spec = self.kv_pool, self.layers[layer_id]
        kbuf, vbuf = pool.k_buffer[layer_id], pool.v_buffer[layer_id]
        if type(pool.kv_dtype) is not KVDtype or kbuf.dtype not in DTYPES:
            raise GraphUnsupported(f"the KV cache ({pool.kv_dtype}) is stored by its plugin; "
                                   f"the cpu backend's graph node writes plain K/V")
        if k.stride(0) != v.stride(0):
            raise GraphUnsupported("the cpu backend's graph node takes k and v rows of one "
                                   "stride")
        lib = load()
        H, KVH, D = spec.num_heads, spec.num_kv_heads, kbuf.shape[-1]
        size = lib.ek_attention_partial_bytes(H, D)
        scratch = getattr(self, "_graph_scratch", None)
        if scratch is None or scratch.numel() < size:
            scratch = self._graph_scratch = torch.empty(size, dtype=torch.uint8)
        args = lib.ek_attention_node_args(
            q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), out.data_ptr(),
            out.stride(0), kbuf.data_ptr(), vbuf.data_ptr(), DTYPES[kbuf.dtype],
            int(pool.needs_scale), H, KVH, D, spec.sliding_window or 0, spec.scaling,
            pool.k_scale[layer_id], pool.v_scale[layer_id], scratch.data_ptr())
        if not args:
            raise GraphUnsupported(f"the cpu backend's graph node cannot take H={H}, "
                                   f"KVH={KVH}, D={D}")
        keep = [CArgs(args, lib.ek_attention_node_free, "an attention graph node"), kbuf, vbuf,
                scratch]

        def node(fn: str, name: str) -> GraphNode:
            return GraphNode(ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value, args,
                             f"{name} layer {layer_id}", keep)

        return [node("ek_attention_store_node", "attention store"),
                node("ek_attention_node", "attention"),
                node("ek_attention_merge_node", "attention merge")]
