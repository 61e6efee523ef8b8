"""Attention backend 'cpu': decode rows through the C kernel, prompt rows through torch SDPA.

A decode step reads every running request's K/V once. The kernel reads them straight from the
pool through ``req_to_token``; torch_native first gathers them into a padded copy, which on a CPU
costs more memory traffic (and page faults) than the attention itself. Rows that bring several
tokens (prompt chunks) are compute-bound and go through torch_native's SDPA groups unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.torch_native import TorchNativeBackend, bucket_prompts, split_rows
from engine.forward_batch import ForwardBatch

from engine_attention_cpu.kernel import decode_attention


class CPUBackend(TorchNativeBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        single, multi = split_rows(batch)
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
        if self.decode is None:  # prompt rows only: torch_native's path as it is
            return super().forward(q, k, v, layer_id, batch)
        pool, spec = self.kv_pool, self.layers[layer_id]
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        out = torch.empty(q.shape, dtype=torch.float32)
        tokens, rows, seq_lens = self.decode
        decode_attention(q.float().contiguous(), out, tokens, pool.k_buffer[layer_id],
                         pool.v_buffer[layer_id], pool.req_to_token, rows, seq_lens,
                         spec.sliding_window, spec.scaling, pool.k_scale[layer_id],
                         pool.v_scale[layer_id])
        self.attend_groups(q, layer_id, out)
        return out.to(q.dtype)
