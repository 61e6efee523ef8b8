"""One forward's worth of requests, as every attention backend sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from engine.host import long_tensor, to_device


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # every request brings prompt tokens (maybe after a cached prefix)
    DECODE = "decode"  # every request brings exactly one token
    MIXED = "mixed"  # both in one step (chunked prefill next to running decodes)


# fmt: off
@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor        # [T] int64: the new tokens of all requests, request after request
    positions: torch.Tensor        # [T] int64: their positions in their sequences
    out_cache_loc: torch.Tensor    # [T] int64: pool slot where each new token's K/V is written
    req_pool_indices: torch.Tensor # [B] int64: each request's row in kv_pool.req_to_token
    prefix_lens: torch.Tensor      # [B] int64: tokens already in the pool before this step
    extend_lens: torch.Tensor      # [B] int64: new tokens this step (1 for a decode)
    seq_lens: torch.Tensor         # [B] int64: prefix_lens + extend_lens
    req_to_token: torch.Tensor     # [R, max_context] int32: position -> slot, shared with the pool
    prefix_lens_list: list[int]    # host copies, so metadata building never syncs a device
    extend_lens_list: list[int]
    logits_indices: torch.Tensor   # [B] int64: index in T of each request's last new token
# fmt: on

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens_list(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens_list, self.extend_lens_list)]

    @classmethod
    def decode(cls, input_ids: list[int], prefix_lens: list[int], req_pool_indices: list[int],
               req_to_token: torch.Tensor, device="cpu",
               out_cache_loc: torch.Tensor | None = None) -> "ForwardBatch":
        """What ``build`` makes of ``[[t] for t in input_ids]`` (a DECODE batch, its slots read
        from ``req_to_token`` unless ``out_cache_loc`` brings them), from one host tensor for
        the per-request lists: a decode step builds this every step, for every running
        request."""
        b = len(input_ids)
        assert b > 0, "every request in a batch brings at least one token"
        host = long_tensor([input_ids, prefix_lens, req_pool_indices, prefix_lens], device)
        ids_t, positions_t, rows_t, prefix_t = host.unbind(0)
        if out_cache_loc is None:
            out_cache_loc = req_to_token[rows_t, positions_t]
        elif out_cache_loc.device != req_to_token.device:  # the host's new slots
            out_cache_loc = to_device(out_cache_loc.to(torch.int64), req_to_token.device)
        return cls(
            mode=ForwardMode.DECODE, input_ids=ids_t, positions=positions_t,
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            req_pool_indices=rows_t, prefix_lens=prefix_t,
            extend_lens=torch.ones(b, dtype=torch.int64, device=device), seq_lens=prefix_t + 1,
            req_to_token=req_to_token, prefix_lens_list=list(prefix_lens),
            extend_lens_list=[1] * b, logits_indices=torch.arange(b, device=device),
        )

    @classmethod
    def build(cls, input_ids: list[list[int]], prefix_lens: list[int], req_pool_indices: list[int],
              out_cache_loc: torch.Tensor | None, req_to_token: torch.Tensor,
              device="cpu") -> "ForwardBatch":
        """Assemble a batch from per-request new tokens (host lists) and their slots
        (``out_cache_loc`` None: read from ``req_to_token`` at the new tokens' positions)."""
        extend = [len(x) for x in input_ids]
        assert all(e > 0 for e in extend), "every request in a batch brings at least one token"
        if all(e == 1 for e in extend):
            mode = ForwardMode.DECODE
        elif all(p == 0 or e > 1 for p, e in zip(prefix_lens, extend)):
            mode = ForwardMode.EXTEND
        else:
            mode = ForwardMode.MIXED
        flat = [t for ids in input_ids for t in ids]
        positions = [p + i for p, e in zip(prefix_lens, extend) for i in range(e)]
        ends = long_tensor(extend).cumsum(0) - 1

        def t(x):
            return long_tensor(x, device)

        positions_t, rows_t, extend_t = t(positions), t(req_pool_indices), t(extend)
        if out_cache_loc is None:
            # output_size: known on the host, so the device need not be asked (a sync)
            out_cache_loc = req_to_token[rows_t.repeat_interleave(extend_t,
                                                                  output_size=len(flat)),
                                         positions_t]
        return cls(
            mode=mode, input_ids=t(flat), positions=positions_t,
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            req_pool_indices=rows_t, prefix_lens=t(prefix_lens),
            extend_lens=extend_t, seq_lens=t([p + e for p, e in zip(prefix_lens, extend)]),
            req_to_token=req_to_token, prefix_lens_list=list(prefix_lens),
            extend_lens_list=extend, logits_indices=to_device(ends, device),
        )
