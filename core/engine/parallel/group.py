"""The tensor-parallel group of one worker: its rank, the world size and the two collectives
the sharded layers use (all-reduce of row-parallel outputs, all-gather of vocab-parallel
logits), over a torch.distributed process group whose backend (gloo on CPU, nccl on CUDA) a
parallel strategy names (builtins/parallel.py; a plugin may register another)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import EngineError


class TPGroup:
    def __init__(self, rank: int, size: int, group=None, ep_size: int = 1):
        """``ep_size``: --ep-size, how many runs of whole experts an MoE layer's experts are
        split into over this group (engine.parallel.experts; 1: every rank a slice of each)."""
        self.rank, self.size, self.group, self.ep_size = rank, size, group, ep_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` (same shape everywhere) concatenated along ``dim``, rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_tp_group(backend: str, rank: int, size: int, init_method: str,
                  timeout: timedelta = timedelta(seconds=600)) -> TPGroup:
    """Join the default process group of ``size`` ranks as ``rank`` (``init_method``: a
    ``tcp://host:port`` rank 0 listens on); ``timeout`` bounds every collective."""
    if not 0 <= rank < size:
        raise EngineError(f"tensor parallelism: rank {rank} is outside 0..{size - 1}.")
    if not dist.is_available():
        raise EngineError("tensor parallelism needs torch.distributed, which this torch build "
                          "lacks.")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timeout)
    return TPGroup(rank, size)
