"""HiCache's copies beside the step (engine/hicache/copier.py): a request whose prefix is in
the host tier waits for its load while the others keep decoding, then gives the outputs of
HiCache off; write-backs free their device slots at once and land later; an aborted waiting
request leaves nothing locked; every tier's accounting holds after every step. The copier is
slowed on purpose (``delay_steps``: a copy counts as done only N steps after it started)."""

import random
from types import SimpleNamespace

import pytest
import torch
from engine import Engine
from engine.scheduler.request import Status
from engine_testing.invariants import assert_all_free, run_checked

GREEDY = {"max_new_tokens": 6, "temperature": 0}
LONG = {"max_new_tokens": 24, "temperature": 0}
DELAY = 4


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def prompt(length, seed):
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(length)]


@pytest.fixture(scope="module")
def reference(model):
    """(A, B) and their outputs with HiCache off, each alone."""
    a, b = prompt(140, 10), prompt(40, 11)
    engine = Engine(model, max_total_tokens=320)
    outs = []
    for p, params in ((a, GREEDY), (b, LONG)):
        [r] = engine.add_request(p, params)
        run_checked(engine, [r])
        outs.append(r.output_ids)
    return (a, b), outs


def hicache(model, **kw):
    return Engine(model, max_total_tokens=320, enable_hierarchical_cache=True, **kw)


def step_checked(engine):
    engine.step()
    engine.scheduler.check_invariants()


def evicted_to_host(engine, p):
    """Run ``p`` once, then evict it from the device pool (its host copy stays)."""
    [r] = engine.add_request(p, GREEDY)
    run_checked(engine, [r])
    tree = engine.scheduler.kv.cache
    tree.drain()
    tree.evict(tree.total_size)
    tree.drain()
    engine.scheduler.check_invariants()
    assert tree.total_size == 0 and tree.host_size >= len(p) - 1
    return r.output_ids


def wait_for(engine, waiter, other, check=lambda: True):
    """Step while ``waiter`` waits for its load: (steps waited, ``other``'s new tokens each
    step it was still running: a slow disk read can outlast it); ``check`` holds at every step
    it waited."""
    waited, progress = 0, []
    while waiter.status is Status.WAITING:
        before, running = len(other.output_ids), other.status is Status.RUNNING
        step_checked(engine)
        if waiter.status is Status.WAITING:
            waited += 1
            if running:
                progress.append(len(other.output_ids) - before)
            assert check()
    return waited, progress


def decoding(engine, p):
    """``p`` admitted and decoding (LONG)."""
    [r] = engine.add_request(p, LONG)
    while not r.output_ids:
        step_checked(engine)
    return r


def test_a_host_load_waits_while_the_batch_decodes(model, reference):
    (a, b), (ref_a, ref_b) = reference
    engine = hicache(model)
    assert evicted_to_host(engine, a) == ref_a
    kv, tree = engine.scheduler.kv, engine.scheduler.kv.cache
    tree.copier.delay_steps = DELAY
    other = decoding(engine, b)
    host_before = kv.stats.hits["host"]

    [waiter] = engine.add_request(a, GREEDY)
    waited, progress = wait_for(engine, waiter, other, lambda: waiter.rid in kv.loads
                                and tree.copies_in_flight)
    assert waited >= DELAY - 1 and all(n == 1 for n in progress), (waited, progress)
    assert waiter.rid not in kv.loads
    run_checked(engine, [waiter, other])
    assert waiter.output_ids == ref_a and other.output_ids == ref_b
    assert waiter.cached_tokens == len(a) - 1
    assert kv.stats.hits["host"] - host_before == len(a) - 1
    assert kv.stats.bytes["host->device"] > 0
    engine.close()
    assert_all_free(engine)


def test_a_stored_prefix_goes_through_the_host_tier_and_waits_like_a_host_load(
        model, reference, tmp_path):
    """A prefix only on disk: its pages (read ahead) become a host-only node, then load back
    like one (on a GPU on the copy stream), the request waiting while the batch decodes."""
    from engine.hicache.settings import STORAGE_PAGE_TOKENS

    (a, b), (ref_a, ref_b) = reference
    engine = hicache(model, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                     hicache_storage_prefetch_policy="wait_complete")
    assert evicted_to_host(engine, a) == ref_a
    kv, tree = engine.scheduler.kv, engine.scheduler.kv.cache
    tree.storage.flush_writes()
    tree.evict_host(tree.host_size)  # only the disk has it now
    assert tree.host_size == 0 and tree.total_size == 0
    tree.copier.delay_steps = DELAY
    other = decoding(engine, b)
    stored = (len(a) - 1) // STORAGE_PAGE_TOKENS * STORAGE_PAGE_TOKENS
    moved = dict(kv.stats.bytes)

    [waiter] = engine.add_request(a, GREEDY)
    waited, progress = wait_for(engine, waiter, other)
    assert waited >= DELAY - 1 and all(n == 1 for n in progress), (waited, progress)
    run_checked(engine, [waiter, other])
    assert waiter.output_ids == ref_a and other.output_ids == ref_b
    assert waiter.cached_tokens == stored and kv.stats.hits["storage"] == stored
    per_token = tree.host.bytes_per_token()
    assert kv.stats.bytes["host->device"] - moved["host->device"] == stored * per_token
    assert kv.stats.bytes["storage->device"] - moved["storage->device"] == stored * per_token
    engine.close()
    assert_all_free(engine)


def test_an_aborted_waiting_request_leaves_its_slots_to_the_cache(model, reference):
    (a, b), _ = reference
    engine = hicache(model)
    evicted_to_host(engine, a)
    kv, tree = engine.scheduler.kv, engine.scheduler.kv.cache
    tree.copier.delay_steps = DELAY
    other = decoding(engine, b)
    [waiter] = engine.add_request(a, GREEDY)
    step_checked(engine)
    assert waiter.status is Status.WAITING and waiter.rid in kv.loads
    assert tree.total_size >= len(a) - 1  # its slots: counted in the tree, locked
    engine.abort(waiter)
    assert not kv.loads and kv._orphans  # the copy is still in flight: locked until it lands
    while kv._orphans:  # it leaves once its copy landed (a write-back may still be going)
        step_checked(engine)
    run_checked(engine, [other])
    assert tree.protected_size == 0  # nothing locked: every cached slot is evictable
    tree.evict(tree.total_size)
    assert kv.pool.free_slots == kv.pool.size
    engine.scheduler.check_invariants()
    engine.close()
    assert_all_free(engine)


def test_a_lone_waiting_request_and_loads_dropped_when_the_batch_is_short(model, reference):
    (a, _), (ref_a, _) = reference
    engine = hicache(model)
    evicted_to_host(engine, a)
    kv, tree = engine.scheduler.kv, engine.scheduler.kv.cache
    tree.copier.delay_steps = DELAY
    [lone] = engine.add_request(a, GREEDY)  # nothing else runs: steps wait for the copy
    run_checked(engine, [lone])
    assert lone.output_ids == ref_a and lone.cached_tokens == len(a) - 1
    tree.evict(tree.total_size)
    [waiter] = engine.add_request(a, GREEDY)
    step_checked(engine)
    assert waiter.rid in kv.loads and tree.protected_size >= len(a) - 1
    kv.drop_loads()  # what _make_room does before retracting anyone
    assert not kv.loads and not tree.copies_in_flight and tree.protected_size == 0
    engine.scheduler.check_invariants()
    run_checked(engine, [waiter])  # it is admitted on the landed (device) prefix
    assert waiter.output_ids == ref_a
    engine.close()
    assert_all_free(engine)


def test_write_backs_free_device_slots_at_once_and_land_later(model, reference):
    (a, b), (ref_a, ref_b) = reference
    engine = hicache(model, hicache_write_policy="write_back")
    [r] = engine.add_request(a, GREEDY)
    run_checked(engine, [r])
    kv, tree = engine.scheduler.kv, engine.scheduler.kv.cache
    tree.copier.delay_steps = DELAY
    assert tree.host_size == 0
    tree.evict(tree.total_size)  # write_back: copied to the host now, from a snapshot
    assert tree.total_size == 0 and kv.pool.free_slots == kv.pool.size  # freed at once
    assert tree.host_size >= len(a) - 1 and tree.copies_in_flight
    engine.scheduler.check_invariants()
    other = decoding(engine, b)
    [again] = engine.add_request(a, GREEDY)  # waits for the write, then for the load
    run_checked(engine, [again, other])
    assert again.output_ids == ref_a and other.output_ids == ref_b
    assert again.cached_tokens == len(a) - 1
    assert kv.stats.bytes["device->host"] > 0 and kv.stats.bytes["host->device"] > 0
    engine.close()
    assert_all_free(engine)


def test_outputs_identical_with_slow_copies_and_many_requests(model):
    ps = [prompt(100, 20 + i) for i in range(5)]
    plain = Engine(model, max_total_tokens=320)
    ref = []
    for p in ps * 2:
        [r] = plain.add_request(p, GREEDY)
        run_checked(plain, [r])
        ref.append(r.output_ids)
    engine = hicache(model, hicache_ratio=4)
    engine.scheduler.kv.cache.copier.delay_steps = 2
    reqs = [r for p in ps for r in engine.add_request(p, GREEDY)]
    run_checked(engine, reqs)
    again = [r for p in ps for r in engine.add_request(p, GREEDY)]
    run_checked(engine, again)
    assert [r.output_ids for r in reqs + again] == ref
    assert engine.scheduler.kv.stats.hits["host"] > 0
    engine.close()
    assert_all_free(engine)


def test_waiters_on_host_loads_do_not_lock_the_pool_up_between_them(model):
    """Multi-turn rounds (benchmarks/hicache.py's shape, small): every conversation's next turn
    extends a prefix that went to the host tier, all queued at once with nothing running. Each
    waiter used to count as "lone" and start its own load, until the loads held the pool and
    none of them could be admitted; only a request with no other load in flight is lone."""
    rng = random.Random(3)
    convs = [[] for _ in range(8)]
    engine = hicache(model, hicache_ratio=4)
    plain = Engine(model, max_total_tokens=320)
    for _ in range(3):
        for h in convs:
            h += [rng.randrange(5, 250) for _ in range(40)]
        reqs = [r for h in convs for r in engine.add_request(list(h), GREEDY)]
        for _ in range(2000):
            if all(r.finished for r in reqs):
                break
            step_checked(engine)
        assert all(r.finished for r in reqs), "stuck: the waiters' loads hold the pool"
        ref = [r for h in convs for r in plain.add_request(list(h), GREEDY)]
        run_checked(plain, ref)
        assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
        for h, r in zip(convs, reqs):
            h += r.output_ids
    assert engine.scheduler.kv.stats.hits["host"] > 0
    engine.close()
    assert_all_free(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_copy_stream_loads_and_backs_up():
    from engine.hicache.copier import CudaCopier
    from engine.hicache.host_pool import HostKVPool

    dev = torch.device("cuda")
    pool = SimpleNamespace(page_size=1, device=dev, copy_journal=None,
                           k_buffer=[torch.randn(64, 2, 8, device=dev) for _ in range(2)],
                           v_buffer=[torch.randn(64, 2, 8, device=dev) for _ in range(2)])
    host = HostKVPool(pool, 32)
    assert host.k[0].is_pinned()
    copier = CudaCopier(dev)
    src, hs = torch.tensor([3, 7, 9, 20]), host.alloc(4)
    up = copier.backup(host, pool, src, hs)
    pool.k_buffer[0][src] = 0  # the snapshot was taken: later writes do not reach the host
    while not up.done():
        pass
    up.finish()
    assert torch.equal(host.k[1][hs], pool.k_buffer[1][src].cpu())
    want = host.k[0][hs].clone()
    dst = torch.tensor([40, 41, 42, 43])
    down = copier.load(host, pool, hs, dst)
    down.order_after()  # the current stream waits on the event, the host does not
    assert torch.equal(pool.k_buffer[0][dst].cpu(), want)
    copier.close()
