"""KVPool: page allocation, the request table, and K/V storage."""

from __future__ import annotations

import random

import pytest
import torch

from engine.interfaces import KVDtype
from engine.memory.kv_pool import KVPool
from engine.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def pool(page_size=1, num_tokens=64, **kw):
    return KVPool(2, 2, 4, num_tokens, torch.float32, page_size=page_size, max_reqs=8,
                  max_context_len=48, **kw)


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_free_invariants(page_size):
    p = pool(page_size)
    assert p.free_slots == p.size == 64 and p.free_reqs == 8
    rng = random.Random(0)
    rows, lens = [], []
    for _ in range(5):
        rows.append(p.alloc_req())
        lens.append(0)
    for _ in range(20):  # grow requests in random steps, as prefill chunks and decodes do
        i = rng.randrange(len(rows))
        n = rng.randint(1, 5)
        before = p.free_slots
        slots = p.extend_slots(rows[i], lens[i], n)
        if slots is None:
            assert p.free_slots == before  # a refusal allocates nothing
            continue
        assert len(slots) == n
        assert before - p.free_slots == p.pages_needed(lens[i], n) * page_size
        lens[i] += n
    held = torch.cat([p.req_to_token[r, :n] for r, n in zip(rows, lens)])
    assert len(set(held.tolist())) == len(held)  # no slot is shared
    assert held.min() >= page_size  # page 0 (scratch) is never handed out
    for r, n in zip(rows, lens):
        row = p.req_to_token[r, :n]
        # positions in one page live in one page, at their offset
        assert torch.equal(row % page_size, torch.arange(n) % page_size)
        pages = row // page_size
        assert torch.equal(pages, pages[torch.arange(n) // page_size * page_size])
    used_pages = sum(-(-n // page_size) for n in lens)
    assert p.free_slots == p.size - used_pages * page_size
    for r, n in zip(rows, lens):
        p.free_pages(p.slots_to_pages(p.req_to_token[r, :n]))
        p.free_req(r)
    assert p.free_slots == p.size and p.free_reqs == 8


def test_refusal_and_double_free():
    p = pool(page_size=4, num_tokens=8)
    r = p.alloc_req()
    assert p.extend_slots(r, 0, 9) is None and p.free_slots == 8
    slots = p.extend_slots(r, 0, 8)
    assert p.free_slots == 0 and p.extend_slots(p.alloc_req(), 0, 1) is None
    p.free_pages(p.slots_to_pages(slots))
    with pytest.raises(AssertionError, match="freed twice"):
        p.free_pages(p.slots_to_pages(slots))


def test_kv_roundtrip_dtype_and_scale():
    p = pool()
    loc = torch.tensor([3, 9])
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    p.set_kv(1, loc, k, v)
    got_k, got_v = p.get_kv(1, loc[None], torch.float32)
    assert torch.equal(got_k[0], k) and torch.equal(got_v[0], v)
    half = KVPool(1, 2, 4, 16, torch.bfloat16)
    half.set_kv(0, loc, k, v)
    got_k, _ = half.get_kv(0, loc, torch.float32)
    assert got_k.dtype == torch.float32 and torch.allclose(got_k, k, atol=0.02, rtol=0.01)
    scaled = KVPool(1, 2, 4, 16, torch.float32, needs_scale=True)
    scaled.k_scale[0], scaled.v_scale[0] = 2.0, 0.5
    scaled.set_kv(0, loc, k, v)
    assert torch.allclose(scaled.k_buffer[0][loc], k / 2)
    got_k, got_v = scaled.get_kv(0, loc, torch.float32)
    assert torch.allclose(got_k, k) and torch.allclose(got_v, v)


def test_runner_sizes_the_pool_in_the_kv_dtype(tiny_model_dir, registries, cpu_device):
    runner = ModelRunner(tiny_model_dir, registries=registries, device=cpu_device,
                         kv_dtype=KVDtype(torch.bfloat16))
    c = runner.model_config
    assert runner.dtype == torch.float32
    assert runner.kv_bytes_per_token() == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2
    kv = runner.init_kv_pool(100, page_size=4)
    assert kv.dtype == torch.bfloat16 and kv.size == 100 and kv.page_size == 4
    assert kv.bytes_per_token() == runner.kv_bytes_per_token()
