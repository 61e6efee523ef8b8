"""KVPool: page allocation, the request table, and K/V storage."""

from __future__ import annotations

import random
from dataclasses import dataclass

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


@pytest.mark.parametrize("page_size", [1, 4])
def test_double_free_in_a_partly_used_pool(page_size):
    """With other pages in use a count of free pages stays in range after a double free; the
    per-page state catches it, leaves the pool as it was, and says which page."""
    p = pool(page_size)
    a, b = p.alloc_req(), p.alloc_req()
    held_a = p.slots_to_pages(p.extend_slots(a, 0, 3 * page_size))
    held_b = p.slots_to_pages(p.extend_slots(b, 0, 5 * page_size))
    p.free_pages(held_a)
    before = p.free_page_count
    with pytest.raises(AssertionError, match=rf"freed twice: page\(s\) \[{held_a[1]}\] is "):
        p.free_pages(held_a[1:2])
    with pytest.raises(AssertionError, match="freed twice"):  # in use, but named twice
        p.free_pages(torch.cat([held_b[:2], held_b[1:2]]))
    with pytest.raises(AssertionError, match="freed twice"):  # one in use, one free
        p.free_pages(torch.stack([held_b[0], held_a[0]]))
    assert p.free_page_count == before  # nothing freed by a refused call
    p.free_pages(held_b)  # the pages in use are still freeable, once
    assert p.free_slots == p.size
    again = p.alloc_pages(p.num_pages)  # every page, once each
    assert sorted(again.tolist()) == list(range(1, p.num_pages + 1))


def test_freeing_the_scratch_page_or_a_page_past_the_pool():
    p = pool(page_size=4)
    p.extend_slots(p.alloc_req(), 0, 8)
    with pytest.raises(AssertionError, match=r"freeing page 0: pages are 1..16 \(page 0 is the "
                                             r"scratch page"):
        p.free_pages([0])
    with pytest.raises(AssertionError, match="freeing page 17: pages are 1..16"):
        p.free_pages([1, 17])
    assert p.free_page_count == 14


def test_request_row_double_free_in_a_partly_used_table():
    p = pool()
    rows = [p.alloc_req() for _ in range(3)]
    p.free_req(rows[0])
    with pytest.raises(AssertionError, match=f"request row {rows[0]} was freed twice"):
        p.free_req(rows[0])
    with pytest.raises(AssertionError, match=r"freeing request row 8: rows are 0..7 \(row 8 is "
                                             r"the scratch row"):
        p.free_req(p.scratch_row)
    assert p.free_reqs == 6


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


@dataclass(frozen=True)
class Int8KV(KVDtype):
    """A KV format a plugin could add: int8 with the per-layer scale, rounded."""

    storage: object = torch.int8
    needs_scale: bool = True

    def store(self, values, scale, storage):
        return (values / scale).round().clamp(-127, 127).to(storage)

    def load(self, stored, scale, dtype):
        return stored.to(dtype) * scale


def test_the_pool_stores_and_loads_through_its_kv_dtype():
    """The pool has no format of its own: a KVDtype subclass brings one, no core change."""
    p = KVPool(1, 2, 4, 16, torch.int8, kv_dtype=Int8KV())
    assert p.needs_scale and p.k_buffer[0].dtype == torch.int8
    p.k_scale[0], p.v_scale[0] = 0.5, 2 ** -6
    loc = torch.tensor([3, 9])
    k, v = torch.tensor([[0.26, -9.0], [100.0, 0.0]]), torch.tensor([[0.5, -0.25], [1.0, 3.0]])
    k, v = k[:, :, None].expand(2, 2, 4), v[:, :, None].expand(2, 2, 4)
    p.set_kv(0, loc, k, v)
    assert p.k_buffer[0][loc][:, :, 0].tolist() == [[1, -18], [127, 0]]  # rounded, clamped
    got_k, got_v = p.get_kv(0, loc, torch.float32)
    assert got_k[:, :, 0].tolist() == [[0.5, -9.0], [63.5, 0.0]]
    assert got_v[:, :, 0].tolist() == [[0.5, -0.25], [1.0, 127 * 2 ** -6]]


def test_a_scaled_float_pool_clamps_to_its_storage_range():
    p = KVPool(1, 2, 4, 16, torch.float8_e4m3fn, needs_scale=True)  # the interface's default
    assert p.kv_dtype == KVDtype(torch.float8_e4m3fn, needs_scale=True)
    p.k_scale[0] = 0.5
    k = torch.full((1, 2, 4), 1e4)
    p.set_kv(0, torch.tensor([1]), k, -k)
    got_k, got_v = p.get_kv(0, torch.tensor([1]), torch.float32)
    assert (got_k == 448 * 0.5).all() and (got_v == -448).all()  # not NaN


def test_the_pool_refuses_a_kv_dtype_it_cannot_honour():
    with pytest.raises(ValueError, match="needs_scale=False contradicts the KV dtype"):
        KVPool(1, 2, 4, 16, torch.int8, needs_scale=False, kv_dtype=Int8KV())
    with pytest.raises(ValueError, match="stores torch.int8 but the pool was asked for "
                                         "torch.float32"):
        KVPool(1, 2, 4, 16, torch.float32, kv_dtype=Int8KV())


def test_runner_sizes_the_pool_in_the_kv_dtype(tiny_model_dir, registries, cpu_device):
    runner = ModelRunner(tiny_model_dir, registries=registries, device=cpu_device,
                         kv_dtype=KVDtype(torch.bfloat16))
    c = runner.model_config
    assert runner.dtype == torch.float32
    assert runner.kv_bytes_per_token() == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2
    kv = runner.init_kv_pool(100, page_size=4)
    assert kv.dtype == torch.bfloat16 and kv.size == 100 and kv.page_size == 4
    assert kv.kv_dtype is runner.kv_dtype  # the pool stores through the runner's KVDtype
    assert kv.bytes_per_token() == runner.kv_bytes_per_token()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_separate_host_table_stays_equal_to_the_device_table(page_size):
    """On a GPU the host reads its own copy of req_to_token (no read waits for the device);
    both writers keep it equal. Here the copy is forced apart from the CPU table."""
    from engine.scheduler.kv import KVManager  # noqa: F401 - the scheduler's reader of it

    pool = KVPool(1, 1, 4, 256, torch.float32, page_size=page_size, max_reqs=4,
                  max_context_len=64)
    pool.host_table = pool.req_to_token.clone()
    rng = random.Random(0)
    rows = [pool.alloc_req() for _ in range(3)]
    lens = {r: 0 for r in rows}
    for _ in range(20):
        r = rng.choice(rows)
        n = rng.randint(1, 5)
        if lens[r] + n > 64:
            continue
        if rng.random() < 0.5:
            assert pool.extend_slots(r, lens[r], n) is not None
        else:  # one decode slot per row, through write_slots (grow_decodes' path)
            n = 1
            pages = pool.alloc_pages(pool.pages_needed(lens[r], 1))
            last = pool.host_table[r, lens[r] - 1] if lens[r] else -1
            slot = pages[0] * page_size if len(pages) else last + 1
            pool.write_slots([r], [lens[r]], torch.tensor([slot]))
        lens[r] += n
    assert torch.equal(pool.host_table, pool.req_to_token)
