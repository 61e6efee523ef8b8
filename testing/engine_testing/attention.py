"""Attention backends side by side on one KV pool: random q/k/v through prompts, decodes and
mixed batches (a sliding-window layer too), every backend's output against a reference's, and
what the CUDA-graph runner does to a fixed batch before a replay."""

from __future__ import annotations

import torch

from engine_testing.generation import free_requests

def compare_backends_step(pool, backends, rows: list[int], lens: list[int],
                          new_lens: list[int], specs, gen: torch.Generator, tol: float,
                          device="cpu", q_dtype: torch.dtype = torch.float32):
    """One step of attention backends side by side on one pool: requests ``rows`` (holding
    ``lens`` tokens) each bring ``new_lens`` tokens; every layer gets the same random q/k/v
    (``q_dtype``) and each backend's output must equal the last one's (the reference) within
    ``tol``, in dtype and shape too. Returns the batch; the pool keeps the new tokens."""
    from engine.forward_batch import ForwardBatch

    locs = [pool.extend_slots(r, n, e) for r, n, e in zip(rows, lens, new_lens)]
    batch = ForwardBatch.build([[0] * e for e in new_lens], lens, rows, torch.cat(locs),
                               pool.req_to_token, device=device)
    for b in backends:
        b.init_forward_metadata(batch)
    for layer, spec in enumerate(specs):
        q, k, v = (torch.randn(batch.num_tokens, n, spec.head_dim, generator=gen)
                   .to(device, q_dtype)
                   for n in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads))
        *ours, ref = (b.forward(q, k, v, layer, batch) for b in backends)
        for out in ours:
            assert out.dtype == ref.dtype == q.dtype and out.shape == q.shape
            torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    return batch


def scattered_filler(pool, page_size: int, pages: int = 24):
    """A filler request whose every other page is freed, so that the next requests' pages
    interleave; returns (its row, its pages). Free ``pages[1::2]`` and the row when done."""
    filler = pool.alloc_req()
    held = pool.slots_to_pages(pool.extend_slots(filler, 0, pages * page_size))
    pool.free_pages(held[::2])
    return filler, held


# five requests: prompts (one over two 32-key blocks, one of a single token), two decode steps
# (past a sliding window of 5), then extends over their cached prefixes beside decodes
MIXED_STEPS = ([9, 1, 70, 4, 33], [1] * 5, [1] * 5, [1, 6, 1, 40, 12])
MIXED_MODES = ("extend", "decode", "decode", "mixed")


def run_mixed_steps(pool, backends, specs, gen, tol: float, device="cpu",
                    q_dtype: torch.dtype = torch.float32, step=None) -> None:
    """MIXED_STEPS through ``step`` (default: :func:`compare_backends_step` on ``device`` with
    ``q_dtype`` queries), asserting each batch's mode; frees the requests."""
    if step is None:
        def step(pool, backends, rows, lens, new, specs, gen, tol):
            return compare_backends_step(pool, backends, rows, lens, new, specs, gen, tol,
                                         device, q_dtype)
    rows = [pool.alloc_req() for _ in MIXED_STEPS[0]]
    lens = [0] * len(rows)
    for new, mode in zip(MIXED_STEPS, MIXED_MODES):
        assert step(pool, backends, rows, lens, new, specs, gen, tol).mode.value == mode
        lens = [n + e for n, e in zip(lens, new)]
    free_requests(pool, rows, lens)


def backend_matches_torch_native(make_backend, shape: tuple[int, int, int], page_size: int,
                                 tol: float = 1e-5, device="cpu") -> None:
    """A backend (``make_backend(ctx)``) against torch_native on one float32 pool whose pages
    interleave with a filler's: MIXED_STEPS through a full and a sliding-window (5) layer of
    ``shape`` (heads, KV heads, head dim); everything freed afterwards."""
    from engine.attention.torch_native import TorchNativeBackend
    from engine.interfaces import AttentionLayerSpec, BackendContext
    from engine.memory.kv_pool import KVPool

    H, KVH, D = shape
    specs = [AttentionLayerSpec(H, KVH, D, D ** -0.5), AttentionLayerSpec(H, KVH, D, 0.3, 5)]
    pool = KVPool(len(specs), KVH, D, 1024, torch.float32, device=device, page_size=page_size,
                  max_reqs=8, max_context_len=512)
    ctx = BackendContext(pool, specs, device, torch.float32)
    filler, pages = scattered_filler(pool, page_size)
    run_mixed_steps(pool, (make_backend(ctx), TorchNativeBackend(ctx)), specs,
                    torch.Generator().manual_seed(0), tol, device)
    pool.free_pages(pages[1::2])
    pool.free_req(filler)
    assert pool.free_slots == pool.size


def refill_batch(fixed, new) -> None:
    """What the CUDA-graph runner does before a replay: ``new``'s tensors and host lists into
    the fixed batch ``fixed`` of the same size, in place (tests of a backend's graph methods)."""
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "prefix_lens",
                 "extend_lens", "seq_lens", "logits_indices"):
        getattr(fixed, name).copy_(getattr(new, name))
    fixed.prefix_lens_list[:] = new.prefix_lens_list
    fixed.extend_lens_list[:] = new.extend_lens_list
