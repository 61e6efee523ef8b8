"""torch_native: attention over the paged KV pool with plain torch SDPA; runs on any device.

Requests are split into two padded groups per step: those bringing one token (decodes, and
1-token prompts) and those bringing several (prompts, maybe after a cached prefix). Each group is
one SDPA call per layer over K/V gathered from the pool, so no Python loop runs per request or
per token. Slot indices and masks are built once per step in ``init_forward_metadata``.

Where no mask is needed it passes none, so SDPA can take its fused (flash) kernels on a GPU: a group
of prompts with no cached prefix and no sliding window is plain causal attention (``is_causal``;
a padded key is only ever seen by a padded query, whose output is dropped). Decode rows are cut into
cache-sized groups only on a CPU; on a GPU they form one group, one SDPA call per layer.

MLA layers (``forward_latent``) go through the same groups: the latent rows are gathered once
per group as one KV head whose keys are the rows and whose values are the rows' first
``kv_lora_rank`` values (a view, no copy), attended by every query head (multi-query).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch
from engine.host import long_tensor
from engine.interfaces import AttentionBackend, BackendContext


# fmt: off
@dataclass
class _Group:
    num_reqs: int
    q_len: int                 # E: padded new tokens per request
    kv_len: int                # L: padded sequence length
    slots: torch.Tensor        # [B, L] pool slot of each key position (0 past the sequence)
    tokens: torch.Tensor | None  # [B, E] index in the batch's T tokens; None: q is [B*E] in order
    dest: torch.Tensor | None  # [n] tokens the group's valid rows write to (None with tokens None)
    rows: torch.Tensor | None  # [n] the valid rows among the B*E padded ones
    masks: dict = field(default_factory=dict)  # sliding window (None: full) -> [B, 1, E, L] bool
    plain_causal: bool = False  # no prefix anywhere: windowless layers use is_causal, no mask
# fmt: on


class TorchNativeBackend(AttentionBackend):
    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        self.kv_pool = ctx.kv_pool
        self.layers = ctx.layers
        self.windows = sorted({s.sliding_window for s in ctx.layers}, key=lambda w: w or 0)
        self.groups: list[_Group] = []  # padded key positions read the pool's zeroed slot 0
        # bytes of one key position's gathered K and V in one layer (K/V are read in ctx.dtype)
        self.kv_bytes = max((s.kv_values_per_token() for s in ctx.layers),
                            default=0) * ctx.dtype.itemsize
        # the decode groups' byte cap is a CPU cache size; a GPU runs all decodes in one call
        self.decode_group_bytes = (None if str(ctx.device).startswith("cuda")
                                   else DECODE_GROUP_BYTES)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        single, multi = split_rows(batch)
        self.groups = [self.make_group(batch, idx) for idx in (
            *bucket_decodes(batch, single, self.kv_bytes, self.decode_group_bytes),
            *bucket_prompts(batch, multi)) if idx]

    def make_group(self, batch: ForwardBatch, idx: list[int]) -> _Group:
        """Padded metadata for the rows ``idx``, attended together by :meth:`attend_group`."""
        dev = batch.input_ids.device
        ext = [batch.extend_lens_list[i] for i in idx]
        seq = [batch.prefix_lens_list[i] + batch.extend_lens_list[i] for i in idx]
        B, E, L = len(idx), max(ext), max(seq)
        # q is already [B, E] in order (bucket_prompts may reorder rows: then it is not)
        whole = B == batch.batch_size and min(ext) == E and idx == list(range(B))
        sel = long_tensor(idx, dev)
        ext_t = batch.extend_lens[sel]
        seq_t = batch.seq_lens[sel]
        kpos = torch.arange(L, device=dev)
        slots = batch.req_to_token[batch.req_pool_indices[sel][:, None], kpos[None, :]]
        slots = torch.where(kpos[None, :] < seq_t[:, None], slots, 0)
        # pad rows repeat the request's last token: a real query whose output is dropped
        e = torch.minimum(torch.arange(E, device=dev)[None, :], ext_t[:, None] - 1)  # [B, E]
        qpos = batch.prefix_lens[sel][:, None] + e
        tokens = dest = rows = None
        if not whole:
            starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
            tokens = starts[sel][:, None] + e
            # the [B, E] positions holding a real token, from the host lengths (a nonzero on
            # the device would wait for it)
            rows = long_tensor(np.concatenate([np.arange(x) + b * E for b, x in enumerate(ext)]),
                               dev)
            dest = tokens.flatten()[rows]
        # no cached prefix: query i is at position i, and E == L
        plain = E > 1 and not any(batch.prefix_lens_list[i] for i in idx)
        g = _Group(B, E, L, slots, tokens, dest, rows, plain_causal=plain)
        causal = kpos[None, None, :] <= qpos[:, :, None]  # [B, E, L]
        for w in self.windows:
            if w is None and plain:
                continue
            m = causal if w is None else causal & (kpos[None, None, :] > qpos[:, :, None] - w)
            g.masks[w] = m[:, None]
        return g

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        T, H, D = q.shape
        if len(self.groups) == 1 and self.groups[0].tokens is None:
            return self.attend_group(self.groups[0], q, layer_id).reshape(T, H, D)
        out = q.new_empty(T, H, D)
        self.attend_groups(q, layer_id, out)
        return out

    def forward_latent(self, q: torch.Tensor, latent: torch.Tensor, layer_id: int,
                       batch: ForwardBatch) -> torch.Tensor:
        self.kv_pool.set_latent(layer_id, batch.out_cache_loc, latent)
        T, H = q.shape[:2]
        dv = self.layers[layer_id].kv_lora_rank
        if len(self.groups) == 1 and self.groups[0].tokens is None:
            return self.attend_group(self.groups[0], q, layer_id).reshape(T, H, dv)
        out = q.new_empty(T, H, dv)
        self.attend_groups(q, layer_id, out)
        return out

    def attend_groups(self, q: torch.Tensor, layer_id: int, out: torch.Tensor) -> None:
        """Every group's valid rows into their tokens' places in ``out`` [T, H, Dv]."""
        H, D = out.shape[1:]
        for g in self.groups:
            assert g.tokens is not None  # only a group holding the whole batch skips the gather
            o = self.attend_group(g, q, layer_id).reshape(-1, H, D)[g.rows]
            out.index_copy_(0, g.dest, o.to(out.dtype))

    def attend_group(self, g: _Group, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Attention for one group: [B, E, H, Dv] (Dv: head_dim, or an MLA layer's
        kv_lora_rank)."""
        spec = self.layers[layer_id]
        B, E = g.num_reqs, g.q_len
        H, D, KVH = spec.num_heads, spec.head_dim, spec.num_kv_heads
        q = q.view(B, E, H, D) if g.tokens is None else q[g.tokens]
        if spec.kv_lora_rank:  # MLA: one head of latent rows, the values their latent part
            k = self.kv_pool.get_latent(layer_id, g.slots, q.dtype)  # [B, L, 1, D]
            v = k[..., :spec.kv_lora_rank]
        else:
            k, v = self.kv_pool.get_kv(layer_id, g.slots, q.dtype)  # [B, L, KVH, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        mask = g.masks.get(spec.sliding_window)
        if mask is None:  # plain causal prompts (see make_group)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                               scale=spec.scaling, enable_gqa=H != KVH)
            return o.transpose(1, 2)
        if E == 1:
            # the G query heads sharing a KV head become G query rows: no K/V copy, one bmm
            qf = q.view(B, KVH, H // KVH, D)
            o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=spec.scaling)
            # [B, KVH, G, Dv] -> [B, 1, H, Dv]: a reshape, since CUDA's SDPA kernels may hand
            # back a strided layout that no view reads as the heads in order
            return o.reshape(B, 1, H, v.shape[-1])
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                           scale=spec.scaling, enable_gqa=H != KVH)
        return o.transpose(1, 2)


def split_rows(batch: ForwardBatch) -> tuple[list[int], list[int]]:
    """The rows bringing one token (decodes, 1-token prompts) and those bringing several."""
    ext = batch.extend_lens_list
    return [i for i, e in enumerate(ext) if e == 1], [i for i, e in enumerate(ext) if e > 1]


# the gathered K and V of one group of decode rows: small enough to stay in the CPU's cache
# between the gather and SDPA, and under malloc's mmap threshold (no page faults per layer)
DECODE_GROUP_BYTES = 8 << 20


def bucket_decodes(batch: ForwardBatch, idx: list[int], kv_bytes: int,
                   cap: int | None = DECODE_GROUP_BYTES) -> list[list[int]]:
    """Decode rows in one group when their padded K/V is under ``cap`` bytes (or ``cap`` is
    None); otherwise sorted by length and cut into groups of at most ``cap`` bytes each (a lone
    long row is a group of its own). Sorting also keeps the padding low: each group pads only to
    its own longest row."""
    seq = batch.seq_lens_list
    if not idx or cap is None or len(idx) * max(seq[i] for i in idx) * kv_bytes <= cap:
        return [idx]
    groups: list[list[int]] = [[]]
    for i in sorted(idx, key=lambda i: seq[i]):
        if groups[-1] and (len(groups[-1]) + 1) * seq[i] * kv_bytes > cap:
            groups.append([])
        groups[-1].append(i)
    return groups


def bucket_prompts(batch: ForwardBatch, idx: list[int]) -> list[list[int]]:
    """Split prompt-bringing requests into groups whose padded [E, L] attention costs at most
    about twice their own: a 500-token prompt next to 50-token suffixes (after a cached prefix)
    would otherwise pad every suffix to 500 queries."""
    cost = {i: batch.extend_lens_list[i] * (batch.prefix_lens_list[i] + batch.extend_lens_list[i])
            for i in idx}
    out, max_e, max_l = [], 0, 0
    for i in sorted(idx, key=lambda i: -cost[i]):
        e, length = batch.extend_lens_list[i], batch.prefix_lens_list[i] + batch.extend_lens_list[i]
        if out and 2 * cost[i] >= max(max_e, e) * max(max_l, length):
            out[-1].append(i)
            max_e, max_l = max(max_e, e), max(max_l, length)
        else:
            out.append([i])
            max_e, max_l = e, length
    return out
