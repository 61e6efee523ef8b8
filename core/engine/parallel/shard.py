"""How a full checkpoint tensor is cut for one rank of a tensor-parallel group.

A cut is ``Cut(dim, parts, index)``: split ``dim`` into ``parts`` equal chunks (the last one
short when it does not divide: a vocabulary) and keep chunk ``index``. Column-parallel weights
(q/k/v, gate/up, and their biases) are cut along dim 0 (output rows), row-parallel ones (o,
down) along dim 1 (input columns), the embedding and the LM head along dim 0 (vocab rows). A
packed projection cuts each of its checkpoint tensors (q, k, v) by its own rule."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.errors import EngineError


@dataclass(frozen=True)
class Cut:
    dim: int
    parts: int
    index: int

    def size(self, full: int) -> int:
        """Rows (along ``dim``) a rank holds out of ``full``: the chunk, padded to equal size."""
        return -(-full // self.parts)

    def bounds(self, full: int) -> tuple[int, int]:
        """(start, length) of this rank's chunk inside the full tensor; length may be short
        (or 0) on the last ranks when ``parts`` does not divide ``full``."""
        size = self.size(full)
        start = min(self.index * size, full)
        return start, min(size, full - start)

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``tensor`` (a view, no copy)."""
        start, length = self.bounds(tensor.shape[self.dim])
        return tensor.narrow(self.dim, start, length)


def split_evenly(total: int, tp_size: int, what: str) -> int:
    """Heads (or rows) per rank when ``total`` are split over ``tp_size`` ranks."""
    if total % tp_size:
        raise EngineError(f"tensor parallelism: {total} {what} do not split over {tp_size} ranks; "
                          f"use a --tp-size that divides {total}.")
    return total // tp_size


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: a share when there are at least as many as ranks, else one
    (replicated: ``tp_size / num_kv_heads`` ranks hold each)."""
    if num_kv_heads >= tp_size:
        return split_evenly(num_kv_heads, tp_size, "KV heads")
    if tp_size % num_kv_heads:
        raise EngineError(f"tensor parallelism: {num_kv_heads} KV heads cannot be replicated "
                          f"evenly over {tp_size} ranks; use a --tp-size that is a multiple of "
                          f"{num_kv_heads}.")
    return 1


def kv_cut(num_kv_heads: int, rank: int, tp_size: int) -> Cut:
    """The cut of k/v projections for ``rank``: its share of heads, or the one head it
    replicates (rank r of tp holds head ``r * num_kv_heads // tp``)."""
    if num_kv_heads >= tp_size:
        return Cut(0, tp_size, rank)
    kv_heads_per_rank(num_kv_heads, tp_size)  # raises when it does not replicate evenly
    return Cut(0, num_kv_heads, rank * num_kv_heads // tp_size)


def rank_head_counts(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds."""
    return split_evenly(num_heads, tp_size, "attention heads"), kv_heads_per_rank(num_kv_heads,
                                                                                 tp_size)


def rank_layer_specs(config, tp_size: int, pp=None) -> list:
    """``config.layer_specs()`` with one rank's head counts: what its attention backend and
    KV pool are built for. ``pp`` (a PPStage): only the stage's layers, in order (their
    sliding windows those of the global layers ``pp.start`` .. ``pp.end - 1``), indexed by the
    layers' local ids."""
    heads, kv_heads = rank_head_counts(config.num_heads, config.num_kv_heads, tp_size)
    specs = config.layer_specs()
    if pp is not None:
        if pp.end > len(specs):
            raise EngineError(f"pipeline parallelism: stage {pp.rank} holds layers {pp.start}.."
                              f"{pp.end - 1} but the model has {len(specs)}.")
        specs = specs[pp.start:pp.end]
    # an MLA layer's one latent "head" is replicated on every rank (engine.parallel.mla)
    return [replace(s, num_heads=heads, num_kv_heads=1 if s.kv_lora_rank else kv_heads)
            for s in specs]
