"""The decode kernel's split-KV path (a request's keys cut into chunks over threads, merged
after) against a plain softmax, at every thread count; and the CPU-graph node's stores, bit for
bit what KVDtype.store keeps."""

from __future__ import annotations

import pytest
import torch

from engine.cpu_graph.builder import GraphBuilder
from engine.cpu_graph.native import load as load_graph
from engine.interfaces import AttentionLayerSpec, BackendContext
from engine.memory.kv_dtype import KVDtype
from engine.memory.kv_pool import KVPool
from engine_attention_cpu import kernel
from engine_attention_cpu.backend import CPUBackend


def reference(q, k, v, scale):
    """q [H, D], k and v [L, KVH, D] -> [H, D]."""
    G = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    w = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * scale, -1)
    return torch.einsum("hl,lhd->hd", w, v)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 16), (8, 1, 48)])
def test_split_requests_match_a_plain_softmax(threads, shape):
    """1-3 requests of 1 to 700 keys (chunks of 32 keys and more, a last chunk of one), a
    sliding window, every thread count: the merged chunks equal one softmax."""
    H, KVH, D = shape
    gen = torch.Generator().manual_seed(threads)
    lens = [700, 33, 1]
    slots = 1 + torch.randperm(sum(lens), generator=gen).to(torch.int32)
    k_pool = torch.randn(sum(lens) + 1, KVH, D, generator=gen)
    v_pool = torch.randn(sum(lens) + 1, KVH, D, generator=gen)
    table = torch.zeros(len(lens), 800, dtype=torch.int32)
    start = 0
    for r, n in enumerate(lens):
        table[r, :n] = slots[start: start + n]
        start += n
    for window in (0, 100):
        for b in (1, 2, 3):
            q = torch.randn(b, H, D, generator=gen)
            out = torch.empty_like(q)
            rows, seq_lens = torch.arange(b), torch.tensor(lens[:b])
            status = kernel.load().decode_attention(
                q.data_ptr(), out.data_ptr(), rows.data_ptr(), k_pool.data_ptr(),
                v_pool.data_ptr(), 0, table.data_ptr(), table.stride(0), rows.data_ptr(),
                seq_lens.data_ptr(), b, H, KVH, D, window, 0.125, 1.0, 1.0,
                threads)
            assert status == 0
            for r in range(b):
                keys = table[r, :lens[r]].long()
                if window and lens[r] > window:
                    keys = keys[-window:]
                ref = reference(q[r], k_pool[keys], v_pool[keys], 0.125)
                assert torch.allclose(out[r], ref, atol=2e-5, rtol=1e-4), (b, r, window)


# edge values: overflow past float16 (inf unscaled, clamped when scaled), float16 subnormals,
# ties of bfloat16 / float16 rounding, a NaN-free spread
EDGES = torch.tensor([70000.0, -1e6, 6e-8, 3e-5, 1.00390625, 1.0 + 2 ** -11, 65519.0, 0.0,
                      -0.0, 1e-40, 3.0e38, -2.5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaled", [False, True])
def test_graph_node_stores_as_the_kv_dtype_does(dtype, scaled):
    """One graph step of the node alone: the new token's K and V at its slot hold exactly
    KVDtype.store's values (rounded to nearest even, scaled and clamped), and its output is
    the kernel's."""
    H, KVH, D = 4, 2, 16
    kv = KVDtype(dtype, needs_scale=scaled)
    pool = KVPool(1, KVH, D, 64, dtype, max_reqs=2, max_context_len=32, kv_dtype=kv)
    if scaled:
        pool.k_scale[0], pool.v_scale[0] = 0.5, 3.0
    backend = CPUBackend(BackendContext(pool, [AttentionLayerSpec(H, KVH, D, 0.25)], "cpu",
                                        torch.float32))
    g = GraphBuilder(2, backend)
    qkv, out = g.buffer((H + 2 * KVH) * D), g.buffer(H * D)
    g.attention(0, qkv[:, : H * D], qkv[:, H * D: (H + KVH) * D], qkv[:, (H + KVH) * D:], out)
    gen = torch.Generator().manual_seed(1)
    k_new = torch.randn(KVH * D, generator=gen) * 3
    k_new[: len(EDGES)] = EDGES
    v_new = torch.randn(KVH * D, generator=gen)
    v_new[-len(EDGES):] = EDGES.flip(0)
    qkv[0, H * D: (H + KVH) * D] = k_new
    qkv[0, (H + KVH) * D:] = v_new
    qkv[0, : H * D] = torch.randn(H * D, generator=gen)
    row = pool.alloc_req()
    slots = pool.extend_slots(row, 0, 3)  # two keys before, the new one at position 2
    for name in ("k_buffer", "v_buffer"):
        getattr(pool, name)[0][slots[:2].long()] = torch.randn(2, KVH, D, generator=gen).to(dtype)
    lib = load_graph()
    graph = lib.ek_graph_new()
    for node in g.nodes:
        lib.ek_graph_add(graph, node.fn, node.args)

    def i64(*x):
        return torch.tensor(x, dtype=torch.int64)

    ids, pos, loc, rows, lens = i64(5), i64(2), slots[2:].long(), i64(row), i64(3)
    lib.ek_graph_run(graph, 2, 1, ids.data_ptr(), pos.data_ptr(), loc.data_ptr(),
                     rows.data_ptr(), lens.data_ptr(), pool.req_to_token.data_ptr(),
                     pool.req_to_token.stride(0))
    lib.ek_graph_free(graph)
    slot = int(slots[2])
    for buf, new, scale in ((pool.k_buffer[0], k_new, pool.k_scale[0]),
                            (pool.v_buffer[0], v_new, pool.v_scale[0])):
        want = kv.store(new.view(KVH, D), scale, dtype)
        assert torch.equal(buf[slot].view(torch.uint8), want.view(torch.uint8))
    # the output: the kernel's on the stored pool
    ref = torch.empty(1, H, D)
    kernel.decode_attention(qkv[:1, : H * D].reshape(1, H, D).contiguous(), ref, i64(0),
                            pool.k_buffer[0], pool.v_buffer[0], pool.req_to_token, i64(row),
                            lens, None, 0.25, pool.k_scale[0], pool.v_scale[0])
    assert torch.allclose(out[0].view(H, D), ref[0], atol=1e-6, rtol=1e-5, equal_nan=True)


def test_loading_the_kernel_leaves_subnormal_floats_alone():
    """The library is built without -ffast-math: linked into a shared object, that flag brings
    crtfastmath, which turns on flush-to-zero for the thread that loads it, and torch's own
    results there then lose their subnormals (and differ from other threads')."""
    import subprocess
    import sys

    code = ("import torch\nfrom engine_attention_cpu import kernel\nkernel.load()\n"
            "x = torch.tensor([1e-40], dtype=torch.float32)\n"
            "print((x * 1.0).item() != 0.0, (x / 2).item() != 0.0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [0, 2])  # float32, float16 pools
def test_a_rows_result_does_not_depend_on_the_other_rows(threads, dtype):
    """Batch invariance: a request's row gives the same bits alone (its keys split over the
    threads), beside a few others (still split) and in a batch too big to split (one thread
    attends it whole, folding the same chunks in the same order): a token verified among
    drafts, or decoded beside other requests, gets what it gets decoded alone."""
    H, KVH, D = 9, 3, 64
    gen = torch.Generator().manual_seed(7 + threads)
    lens = [300, 129, 700, 17, 64, 1000, 5, 250, 33, 480, 2, 900]
    total = sum(lens) + 1
    k_pool = torch.randn(total, KVH, D, generator=gen)
    v_pool = torch.randn(total, KVH, D, generator=gen)
    if dtype == 2:
        k_pool, v_pool = k_pool.half(), v_pool.half()
    table = torch.zeros(len(lens), 1024, dtype=torch.int32)
    slots = 1 + torch.randperm(sum(lens), generator=gen).to(torch.int32)
    start = 0
    for r, n in enumerate(lens):
        table[r, :n] = slots[start: start + n]
        start += n
    q_all = torch.randn(len(lens), H, D, generator=gen)

    def attend(reqs):
        rows = torch.tensor(reqs)
        q = q_all[rows].contiguous()
        out = torch.empty_like(q)
        seq_lens = torch.tensor([lens[r] for r in reqs])
        qi = torch.arange(len(reqs))
        assert kernel.load().decode_attention(
            q.data_ptr(), out.data_ptr(), qi.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
            dtype, table.data_ptr(), table.stride(0), rows.data_ptr(), seq_lens.data_ptr(),
            len(reqs), H, KVH, D, 0, 0.125, 1.0, 1.0, threads) == 0
        return {r: out[i] for i, r in enumerate(reqs)}

    everyone = attend(list(range(len(lens))))  # 12 rows: no split below 4 per thread
    for r in range(len(lens)):
        alone = attend([r])[r]
        assert torch.equal(alone, everyone[r]), (r, lens[r])
    assert all(torch.equal(v, everyone[r]) for r, v in attend([5, 0, 3]).items())


def _attend(q, rows, seq_lens, k_pool, v_pool, table, H, KVH, D, window, threads):
    out = torch.empty_like(q)
    b = q.shape[0]
    q_rows = torch.arange(b)
    status = kernel.load().decode_attention(
        q.data_ptr(), out.data_ptr(), q_rows.data_ptr(), k_pool.data_ptr(),
        v_pool.data_ptr(), 0, table.data_ptr(), table.stride(0), rows.data_ptr(),
        seq_lens.data_ptr(), b, H, KVH, D, window, 0.125, 1.0, 1.0, threads)
    assert status == 0
    return out


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 1, 48)])
def test_rows_of_one_request_attended_together_get_their_bits_alone(threads, shape):
    """A request's rows side by side (draft tokens verified at once: the same table row,
    lengths L, L + 1, ...) are attended as a group, the keys fetched once for all of them;
    each row's output is bit for bit the one it gets attended alone, where the rows' chunk
    size differs (lengths across a multiple of 64), with a sliding window, with more rows than
    a group holds (20), beside other requests' rows, split over threads or whole."""
    H, KVH, D = shape
    gen = torch.Generator().manual_seed(threads)
    n_slots = 2000
    k_pool = torch.randn(n_slots, KVH, D, generator=gen)
    v_pool = torch.randn(n_slots, KVH, D, generator=gen)
    table = torch.stack([1 + torch.randperm(n_slots - 1, generator=gen)[:800]
                         for _ in range(4)]).to(torch.int32)
    for start, count in ((1, 8), (30, 8), (60, 8), (124, 8), (250, 5), (700, 20)):
        for others in (0, 9):  # 9 one-row requests beside: whole groups, not split
            rows = [0] * count + [1 + i % 3 for i in range(others)]
            lens = [start + i for i in range(count)] + [40 + 50 * i for i in range(others)]
            rows_t, lens_t = torch.tensor(rows), torch.tensor(lens)
            q = torch.randn(len(rows), H, D, generator=gen)
            for window in (0, 100):
                together = _attend(q, rows_t, lens_t, k_pool, v_pool, table, H, KVH, D,
                                   window, threads)
                for i in range(len(rows)):
                    alone = _attend(q[i: i + 1].contiguous(), rows_t[i: i + 1],
                                    lens_t[i: i + 1], k_pool, v_pool, table, H, KVH, D,
                                    window, threads)
                    assert torch.equal(together[i], alone[0]), (start, count, others, window, i)
                    keys = table[rows[i], :lens[i]].long()
                    if window and lens[i] > window:
                        keys = keys[-window:]
                    ref = reference(q[i], k_pool[keys], v_pool[keys], 0.125)
                    assert torch.allclose(together[i], ref, atol=2e-5, rtol=1e-4)
