"""torch_native attention: against a per-request reference, and through the runner: cached
prefixes, mixed batches and paged pools give what plain prefill gives."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_native import TorchNativeBackend
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.interfaces import AttentionLayerSpec, BackendContext
from engine.memory.kv_pool import KVPool
from engine.runner import ModelRunner
from engine_testing.generation import free_requests, greedy_generate

pytestmark = pytest.mark.usefixtures("single_torch_thread")

H, KVH, D = 4, 2, 8
SPECS = [AttentionLayerSpec(H, KVH, D, D ** -0.5), AttentionLayerSpec(H, KVH, D, D ** -0.5, 3)]


def reference(q, pool, layer, spec, batch):
    """Per request, per query: softmax over its own keys, causal, within the window."""
    out, start = torch.empty_like(q), 0
    for i, (p, e) in enumerate(zip(batch.prefix_lens_list, batch.extend_lens_list)):
        slots = batch.req_to_token[batch.req_pool_indices[i], : p + e]
        k, v = pool.get_kv(layer, slots, q.dtype)
        k = k.repeat_interleave(H // KVH, 1)
        v = v.repeat_interleave(H // KVH, 1)
        for t in range(e):
            pos = p + t
            keys = torch.arange(p + e)
            allowed = keys <= pos
            if spec.sliding_window:
                allowed &= keys > pos - spec.sliding_window
            s = torch.einsum("hd,khd->hk", q[start + t], k) * spec.scaling
            s = s.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[start + t] = torch.einsum("hk,khd->hd", s, v)
        start += e
    return out


def run_step(pool, backend, rows, lens, new_lens, gen):
    locs = [pool.extend_slots(r, n, e) for r, n, e in zip(rows, lens, new_lens)]
    ids = [[0] * e for e in new_lens]
    batch = ForwardBatch.build(ids, lens, rows, torch.cat(locs), pool.req_to_token)
    backend.init_forward_metadata(batch)
    T = batch.num_tokens
    for layer, spec in enumerate(SPECS):
        q, k, v = (torch.randn(T, n, D, generator=gen) for n in (H, KVH, KVH))
        got = backend.forward(q, k, v, layer, batch)
        torch.testing.assert_close(got, reference(q, pool, layer, spec, batch),
                                   atol=1e-5, rtol=1e-5)
    return batch


@pytest.mark.parametrize("page_size", [1, 4])
def test_backend_matches_reference_in_every_mode(page_size):
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(len(SPECS), KVH, D, 256, torch.float32, page_size=page_size, max_reqs=8,
                  max_context_len=64)
    backend = TorchNativeBackend(BackendContext(pool, SPECS, "cpu", torch.float32))
    rows = [pool.alloc_req() for _ in range(4)]
    # prompts of different lengths, one of a single token
    batch = run_step(pool, backend, rows, [0, 0, 0, 0], [7, 1, 12, 5], gen)
    assert batch.mode == ForwardMode.EXTEND
    lens = [7, 1, 12, 5]
    # pure decode takes the no-gather path
    batch = run_step(pool, backend, rows, lens, [1, 1, 1, 1], gen)
    assert batch.mode == ForwardMode.DECODE and backend.groups[0].tokens is None
    lens = [n + 1 for n in lens]
    # mixed: two decodes next to a chunk after a prefix and a new prompt-sized chunk
    batch = run_step(pool, backend, rows, lens, [1, 6, 1, 9], gen)
    # one padded group for the decodes; the two prompt chunks differ enough in padded cost
    # (6x8 vs 9x15 query-key pairs) to be split, so every group pays at most ~2x its own cost
    assert batch.mode == ForwardMode.MIXED
    assert sorted(g.q_len for g in backend.groups) == [1, 6, 9]
    lens = [n + e for n, e in zip(lens, [1, 6, 1, 9])]
    # equal extends after prefixes of different lengths (a verify step of speculative
    # decoding, chunks after radix hits): the groups order rows by cost, not as the batch has
    # them, so q must be gathered even though the rows fill the batch
    batch = run_step(pool, backend, rows, lens, [3, 3, 3, 3], gen)
    assert batch.mode == ForwardMode.EXTEND
    free_requests(pool, rows, [n + 3 for n in lens])
    assert pool.free_slots == pool.size



def test_long_decode_batches_are_cut_into_cache_sized_groups():
    import engine.attention.torch_native as tn

    gen = torch.Generator().manual_seed(3)
    pool = KVPool(len(SPECS), KVH, D, 512, torch.float32, max_reqs=8, max_context_len=128)
    backend = TorchNativeBackend(BackendContext(pool, SPECS, "cpu", torch.float32))
    assert backend.kv_bytes == 2 * KVH * D * 4
    assert backend.decode_group_bytes == tn.DECODE_GROUP_BYTES
    backend.decode_group_bytes = cap = 100 * backend.kv_bytes  # 100 padded key positions a group
    rows = [pool.alloc_req() for _ in range(6)]
    lens = [40, 3, 25, 9, 60, 18]
    run_step(pool, backend, rows, [0] * 6, lens, gen)
    run_step(pool, backend, rows, lens, [1] * 6, gen)  # checked against the reference
    # sorted by length (4, 10, 19, 26, 41, 61), each group within 100 padded positions
    groups = [[lens[i] + 1 for i in g] for g in
              tn.bucket_decodes(ForwardBatch.build([[0]] * 6, lens, rows, torch.zeros(6),
                                                   pool.req_to_token), list(range(6)),
                                backend.kv_bytes, cap)]
    assert groups == [[4, 10, 19], [26, 41], [61]]
    assert [g.num_reqs for g in backend.groups] == [3, 2, 1]
    free_requests(pool, rows, [n + 1 for n in lens])
    assert pool.free_slots == pool.size

def test_prompts_without_a_prefix_use_no_mask_and_gpu_decodes_one_group():
    """Prompts with no cached prefix: windowless layers run SDPA with is_causal and no mask
    (the fused kernels on a GPU); a backend made for a CUDA device keeps every decode in one
    group. Both checked against the per-request reference (on the CPU, with that setting)."""
    gen = torch.Generator().manual_seed(5)
    pool = KVPool(len(SPECS), KVH, D, 512, torch.float32, max_reqs=8, max_context_len=128)
    backend = TorchNativeBackend(BackendContext(pool, SPECS, "cpu", torch.float32))
    assert TorchNativeBackend(BackendContext(pool, SPECS, "cuda", torch.float32)
                              ).decode_group_bytes is None
    backend.decode_group_bytes = None
    rows = [pool.alloc_req() for _ in range(4)]
    lens = [30, 2, 17, 9]
    run_step(pool, backend, rows, [0] * 4, lens, gen)
    assert [g.plain_causal for g in backend.groups] == [True] * len(backend.groups)
    assert all(None not in g.masks and 3 in g.masks for g in backend.groups)
    batch = run_step(pool, backend, rows, lens, [1] * 4, gen)
    assert batch.mode == ForwardMode.DECODE and len(backend.groups) == 1
    assert not backend.groups[0].plain_causal
    lens = [n + 1 for n in lens]
    run_step(pool, backend, rows, lens, [4, 1, 3, 1], gen)  # after a prefix: masks again
    assert all(not g.plain_causal and None in g.masks for g in backend.groups)
    free_requests(pool, rows, [n + e for n, e in zip(lens, [4, 1, 3, 1])])
    assert pool.free_slots == pool.size


@pytest.fixture(scope="module")
def runner(tiny_model_factory, registries, cpu_device):
    r = ModelRunner(tiny_model_factory("mistral_window"), registries=registries,
                    device=cpu_device, dtype="float32")
    r.init_kv_pool(2048)
    return r


def forward(runner, new, prefix_lens, rows, return_all_logits=False):
    pool = runner.kv_pool
    locs = torch.cat([pool.extend_slots(r, p, len(x)) for r, p, x in zip(rows, prefix_lens, new)])
    batch = ForwardBatch.build(new, prefix_lens, rows, locs, pool.req_to_token)
    return runner.forward(batch, return_all_logits)


PROMPT = list(range(3, 33))  # 30 tokens, longer than the 12-token window


@pytest.mark.parametrize("cached", [1, 8, 29])
def test_cached_prefix_gives_the_logits_of_a_full_prefill(runner, cached):
    pool = runner.kv_pool
    a, b = pool.alloc_req(), pool.alloc_req()
    full = forward(runner, [PROMPT], [0], [a], return_all_logits=True)
    # request b reuses a's first `cached` slots, as a prefix cache hit would
    pool.req_to_token[b, :cached] = pool.req_to_token[a, :cached]
    rest = forward(runner, [PROMPT[cached:]], [cached], [b], return_all_logits=True)
    torch.testing.assert_close(rest, full[cached:], atol=1e-5, rtol=1e-5)
    free_requests(pool, [a], [len(PROMPT)])
    pool.free_pages(pool.slots_to_pages(pool.req_to_token[b, cached:len(PROMPT)]))
    pool.free_req(b)
    assert pool.free_slots == pool.size


def test_mixed_batch_equals_separate_runs(runner):
    pool = runner.kv_pool
    prompt_b = list(range(40, 61))
    # separately: a's prefill then a's decode; b's prefill
    a, b = pool.alloc_req(), pool.alloc_req()
    first = forward(runner, [PROMPT], [0], [a]).argmax(-1).tolist()
    alone_a = forward(runner, [first], [len(PROMPT)], [a])
    alone_b = forward(runner, [prompt_b], [0], [b])
    # together: a2 decodes while b2 prefills, and c2 extends a chunk after a cached prefix
    a2, b2, c2 = pool.alloc_req(), pool.alloc_req(), pool.alloc_req()
    forward(runner, [PROMPT], [0], [a2])
    pool.req_to_token[c2, :10] = pool.req_to_token[a2, :10]
    mixed = forward(runner, [first, prompt_b, PROMPT[10:]], [len(PROMPT), 0, 10], [a2, b2, c2])
    torch.testing.assert_close(mixed[0], alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1], alone_b[0], atol=1e-5, rtol=1e-5)
    # c2 saw PROMPT, so its last logits predicted `first`
    assert mixed[2].argmax().item() == first[0]
    n = len(PROMPT) + 1
    free_requests(pool, [a, b, a2, b2], [n, len(prompt_b), n, len(prompt_b)])
    pool.free_pages(pool.slots_to_pages(pool.req_to_token[c2, 10:len(PROMPT)]))
    pool.free_req(c2)
    assert pool.free_slots == pool.size


def test_page_size_4_gives_identical_generations(tiny_model_factory, registries, cpu_device):
    path = tiny_model_factory("mistral_window")
    prompts = [PROMPT, list(range(50, 57)), [7, 8], list(range(100, 119))]
    outs = []
    for page_size in (1, 4):
        r = ModelRunner(path, registries=registries, device=cpu_device, dtype="float32")
        r.init_kv_pool(1024, page_size=page_size)
        outs.append(greedy_generate(r, prompts, 20))
        assert r.kv_pool.free_slots == r.kv_pool.size
    assert outs[0] == outs[1]
