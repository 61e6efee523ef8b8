"""The Triton kernels' launch geometry (kernels.py): block sizes, grids within CUDA's limits and
the split-KV decode's split count, from the batch, the heads and the SM count."""

from __future__ import annotations

import triton

GRID_YZ_MAX = 65535  # CUDA's limit on a grid's y and z dimensions
GRID_X_MAX = 2 ** 31 - 1
MAX_KV_SPLITS = 16


def block_sizes(max_ext: int, group: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of ``_paged_attention``: 128 rows for prompt chunks (64
    past a head dim of 128, for registers), just enough rows (at least 16, tl.dot's minimum)
    when every request brings fewer tokens x heads per KV head."""
    rows = max_ext * group
    block_m = min(128 if head_dim <= 128 else 64, max(16, triton.next_power_of_2(rows)))
    block_n = 64 if head_dim <= 128 else 32
    return block_m, block_n, 8 if block_m >= 128 else 4


def prefill_grid(batch: int, kv_heads: int, group: int, max_ext: int,
                 block_m: int) -> tuple[int]:
    """``_paged_attention``'s grid: every (request, KV head, row block) in x."""
    return (batch * kv_heads * triton.cdiv(max_ext * group, block_m),)


def decode_head_block(group: int) -> tuple[int, int]:
    """(BLOCK_H, head blocks per KV head) of the split decode: a KV head's G query heads in
    blocks of 16..64 rows (tl.dot needs at least 16)."""
    block_h = min(64, max(16, triton.next_power_of_2(group)))
    return block_h, triton.cdiv(group, block_h)


def num_kv_splits(batch: int, kv_heads: int, group: int, sm_count: int,
                  max_seq_len: int | None = None, max_splits: int = MAX_KV_SPLITS,
                  min_split_keys: int = 256) -> int:
    """Splits of each request's keys for a decode step: enough (request, KV head, head block)
    x split programs for about two per SM, at most ``max_splits``; with ``max_seq_len`` (a
    host int; None inside CUDA graphs, whose grid is fixed) no more splits than chunks of
    ``min_split_keys`` keys. 1: no split (the one-pass kernel serves the step)."""
    programs = batch * kv_heads * decode_head_block(group)[1]
    splits = max(1, min(max_splits, (2 * sm_count) // max(programs, 1)))
    if max_seq_len is not None:
        splits = min(splits, max(1, triton.cdiv(max_seq_len, min_split_keys)))
    return splits


def decode_grids(batch: int, heads: int, kv_heads: int, splits: int) -> tuple[tuple, tuple]:
    """The grids of the split decode's two stages."""
    hb = decode_head_block(heads // kv_heads)[1]
    return (batch, kv_heads * hb, splits), (batch, heads)
