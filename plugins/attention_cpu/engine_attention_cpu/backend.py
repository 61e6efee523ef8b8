"""Attention backend 'cpu': decode rows through the C kernel, prompt rows through torch SDPA.

A decode step reads every running request's K/V once. The kernel reads them straight from the
pool through ``req_to_token``; torch_native first gathers them into a padded copy, which on a CPU
costs more memory traffic (and page faults) than the attention itself. Rows that bring several
tokens (prompt chunks) are compute-bound and go through torch_native's SDPA groups unchanged.
"""

from __future__ import annotations

import torch

from engine.attention.torch_native import TorchNativeBackend, bucket_prompts, split_rows
from engine.forward_batch import ForwardBatch

from engine_attention_cpu.kernel import decode_attention


class CPUBackend(TorchNativeBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        single, multi = split_rows(batch)
        self.groups = [self.make_group(batch, idx) for idx in bucket_prompts(batch, multi)]
        self.decode = None
        if single:
            sel = torch.tensor(single, dtype=torch.int64)
            starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
            # (index of the row's token in the batch, its req_to_token row, its length)
            self.decode = (starts[sel].contiguous(), batch.req_pool_indices[sel].contiguous(),
                           batch.seq_lens[sel].contiguous())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        pool = self.kv_pool
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        T, H, D = q.shape
        if self.decode is None and len(self.groups) == 1 and self.groups[0].tokens is None:
            return self.attend_group(self.groups[0], q, layer_id).view(T, H, D)
        out = torch.empty(T, H, D, dtype=torch.float32)
        if self.decode is not None:
            spec = self.layers[layer_id]
            tokens, rows, seq_lens = self.decode
            decode_attention(q.float().contiguous(), out, tokens, pool.k_buffer[layer_id],
                             pool.v_buffer[layer_id], pool.req_to_token, rows, seq_lens,
                             spec.sliding_window, spec.scaling, pool.k_scale[layer_id],
                             pool.v_scale[layer_id])
        for g in self.groups:
            o = self.attend_group(g, q, layer_id).reshape(-1, H, D)[g.rows]
            out.index_copy_(0, g.dest, o.float())
        return out.to(q.dtype)
