"""The scheduler: invariants under random load, retraction, chunking, prefix cache, policies."""

import logging
import random
import re

import pytest

from engine import Engine
from engine.engine import RequestError
from engine_testing.invariants import assert_all_free

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def make(model, **kw):
    return Engine(model, **{"max_total_tokens": 4000, **kw})


def ids(seed, n, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run_all(engine, prompts, max_new):
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new})
    engine.scheduler.check_invariants()
    return [o["output_ids"] for o in outs]


def test_random_workload_keeps_slot_invariant(model):
    rng = random.Random(0)
    engine = make(model, max_total_tokens=320, chunked_prefill_size=48)
    system = ids(99, 24)
    pending = []
    for i in range(40):
        prompt = (system if rng.random() < 0.5 else []) + ids(i, rng.randint(1, 60))
        params = {"max_new_tokens": rng.randint(1, 30), "ignore_eos": rng.random() < 0.5,
                  "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 9)}
        pending.append((prompt, params))
    reqs, steps = [], 0
    while pending or engine.scheduler.has_work:
        for _ in range(rng.randint(0, 3)):  # random arrival
            if pending:
                reqs += engine.add_request(*pending.pop())
        engine.step()
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < 5000
    assert all(r.finished for r in reqs) and len(reqs) == 40
    assert all(1 <= len(r.output_ids) <= r.params.max_new_tokens for r in reqs)
    assert_all_free(engine)


def test_retraction_storm_finishes_with_identical_outputs(model, caplog):
    prompts = [ids(i, 20 + i) for i in range(8)]
    reference = run_all(make(model), prompts, 40)
    small = make(model, max_total_tokens=160, schedule_conservativeness=0.1)
    with caplog.at_level(logging.WARNING, logger="engine"):
        outs = run_all(small, prompts, 40)
    lines = [r.getMessage() for r in caplog.records if "decode out of memory" in r.getMessage()]
    assert lines, "the pool was meant to be too small"
    assert re.fullmatch(r"decode out of memory happened, #retracted_reqs: \d+, "
                        r"#new_token_ratio: \d\.\d{4} -> \d\.\d{4}", lines[0])
    assert small.scheduler.counters.retracted_reqs >= 1
    assert outs == reference
    assert_all_free(small)


def test_chunked_prefill_equals_unchunked(model):
    prompts = [ids(7, 150), ids(8, 5)]
    whole = run_all(make(model, chunked_prefill_size=-1), prompts, 12)
    chunked_engine = make(model, chunked_prefill_size=16)
    chunked = run_all(chunked_engine, prompts, 12)
    assert chunked == whole
    assert_all_free(chunked_engine)


def test_shared_prefix_reports_cached_tokens_and_matches_no_cache(model):
    system = ids(1, 40)
    prompts = [system + ids(10 + i, 6) for i in range(4)]
    cached = make(model)
    first = cached.generate(input_ids=prompts[0], sampling_params={**GREEDY, "max_new_tokens": 8})
    rest = cached.generate(input_ids=prompts[1:], sampling_params={**GREEDY, "max_new_tokens": 8})
    assert first["meta_info"]["cached_tokens"] == 0
    assert all(o["meta_info"]["cached_tokens"] >= 40 for o in rest)
    assert cached.scheduler.counters.cache_hit_rate > 0.5
    plain = make(model, disable_radix_cache=True)
    assert plain.scheduler.kv.cache is None
    expected = run_all(plain, prompts, 8)
    assert [first["output_ids"]] + [o["output_ids"] for o in rest] == expected
    assert_all_free(cached)
    assert_all_free(plain)


def admitted_first(engine, prompts):
    reqs = [engine.add_request(p, {**GREEDY, "max_new_tokens": 2})[0] for p in prompts]
    engine.step()
    first = [i for i, r in enumerate(reqs) if r.status.value == "running" or r.finished]
    while engine.scheduler.has_work:
        engine.step()
    return first


@pytest.mark.parametrize("policy, expected", [("lpm", [1]), ("fcfs", [0]), ("lifo", [2])])
def test_policies_order_the_queue(model, policy, expected):
    engine = make(model, schedule_policy=policy, max_running_requests=1)
    system = ids(3, 60)
    engine.generate(input_ids=system + [7], sampling_params={**GREEDY, "max_new_tokens": 1})
    # 0: no cached prefix (arrived first), 1: long cached prefix, 2: arrived last
    assert admitted_first(engine, [ids(4, 30), system + ids(5, 3), ids(6, 30)]) == expected
    assert_all_free(engine)


def test_lower_conservativeness_admits_more_at_once(model):
    prompts = [ids(20 + i, 10) for i in range(10)]

    def admitted(conservativeness):
        engine = make(model, max_total_tokens=400, schedule_conservativeness=conservativeness)
        for p in prompts:
            engine.add_request(p, {**GREEDY, "max_new_tokens": 100})
        engine.step()
        n = len(engine.scheduler.running)
        engine.scheduler.check_invariants()
        return n

    assert admitted(0.3) > admitted(1.0)


def test_max_running_requests_caps_the_batch(model):
    engine = make(model, max_running_requests=3)
    for i in range(6):
        engine.add_request(ids(i, 8), {**GREEDY, "max_new_tokens": 5})
    while engine.scheduler.has_work:
        engine.step()
        assert len(engine.scheduler.running) <= 3


def test_max_model_len_rejects_with_a_clear_error(model):
    engine = make(model, max_model_len=64)
    with pytest.raises(RequestError, match="maximum context length is 64 tokens.*60 in the prompt"
                                           " \\+ 10 new"):
        engine.add_request(ids(0, 60), {"max_new_tokens": 10})
    assert not engine.scheduler.has_work


def test_page_size_four_gives_identical_outputs(model):
    prompts = [ids(30 + i, 9 + 5 * i) for i in range(4)] + [ids(30, 9) + ids(31, 7)]
    expected = run_all(make(model), prompts, 10)
    paged = make(model, page_size=4, max_total_tokens=400)
    assert run_all(paged, prompts, 10) == expected
    assert run_all(paged, prompts, 10) == expected  # again, now with cached pages
    assert_all_free(paged)


def test_log_lines_use_the_guides_wording(model, caplog):
    engine = make(model, decode_log_interval=1)
    with caplog.at_level(logging.INFO, logger="engine"):
        run_all(engine, [ids(0, 12), ids(1, 20)], 3)
    messages = [r.getMessage() for r in caplog.records]
    assert any(re.fullmatch(
        r"Prefill batch\. #new-seq: 2, #new-token: 32, #cached-token: 0, token usage: \d\.\d\d, "
        r"#running-req: 2, #queue-req: 0", m) for m in messages), messages
    assert any(re.fullmatch(
        r"Decode batch\. #running-req: 2, #token: \d+, token usage: \d\.\d\d, "
        r"cuda graph: False, gen throughput \(token/s\): \d+\.\d\d, #queue-req: 0", m) for m in messages), messages


def test_n_samples_share_the_prompt_and_free_everything(model):
    engine = make(model)
    prompt = ids(42, 30)
    outs = engine.generate(input_ids=prompt, sampling_params={"n": 4, "temperature": 1.0,
                                                              "seed": 5, "max_new_tokens": 12})
    assert len(outs) == 4
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # different samples
    assert sum(o["meta_info"]["cached_tokens"] for o in outs[1:]) >= 3 * 29  # shared prefix KV
    assert_all_free(engine)


def test_a_full_batch_does_not_order_or_match_the_queue(model):
    engine = make(model, max_running_requests=2)
    s = engine.scheduler
    reqs = [engine.add_request(ids(i, 12), {**GREEDY, "max_new_tokens": 6})[0] for i in range(5)]
    while len(s.running) < 2 or any(r.prefilling for r in s.running):
        engine.step()
    calls = []
    order, match = s.policy.order, s.kv.match
    s.policy.order = lambda *a: calls.append("order") or order(*a)
    s.kv.match = lambda *a: calls.append("match") or match(*a)
    while len(s.running) == 2 and not any(r.finished for r in reqs):
        engine.step()  # two decodes, three waiting: nothing can be admitted
    assert calls == []
    while s.has_work:
        engine.step()
    assert "order" in calls and all(r.finished for r in reqs)
    assert [r.output_ids for r in reqs] == run_all(make(model), [ids(i, 12) for i in range(5)], 6)
    assert_all_free(engine)


def test_many_finishing_in_one_step_and_aborts_keep_the_invariants(model):
    engine = make(model, page_size=4)
    s = engine.scheduler
    reqs = [engine.add_request(ids(i, 5 + i), {**GREEDY, "max_new_tokens": 4 + i % 2})[0]
            for i in range(12)]
    engine.step()
    engine.abort(reqs[0])  # running
    engine.abort(reqs[0])  # twice is harmless
    while s.has_work:
        engine.step()
        s.check_invariants()
        assert all(r.status.value == "running" for r in s.running)
    assert reqs[0].finish_reason == "abort"
    assert [len(r.output_ids) for r in reqs[1:]] == [4 + i % 2 for i in range(1, 12)]
    assert_all_free(engine)


# -- the KV owner (engine.scheduler.kv.KVManager), without a model ------------------------------

def kv_manager(page_size=1, num_tokens=64, max_reqs=4, cache=True):
    import torch

    from engine.memory.kv_pool import KVPool
    from engine.memory.radix_cache import RadixCache
    from engine.scheduler.kv import KVManager

    pool = KVPool(1, 1, 2, num_tokens, torch.float32, page_size=page_size, max_reqs=max_reqs,
                  max_context_len=64)
    return KVManager(pool, RadixCache(pool.free_slots_of, page_size) if cache else None)


def kv_req(prompt, max_new=8):
    from types import SimpleNamespace

    from engine.scheduler.request import Req

    return Req(f"r{prompt[:3]}", list(prompt), SimpleNamespace(max_new_tokens=max_new))


def assert_kv_consistent(kv, running):
    """The slot invariant, and more: every page is free, the tree's or one request's (never
    two), each row's cached part is the tree's slots along its locked path, and every node is
    locked exactly as often as running requests hold paths through it."""
    kv.check(running)
    pool, cache, page = kv.pool, kv.cache, kv.page
    owners = [pool._free_stack[:pool._top].tolist()]
    locks, stack = {}, [cache.root] if cache else []
    while stack:
        node = stack.pop()
        for child in node.children.values():
            owners.append((child.value // page).unique().tolist())
            locks[child] = 0
            stack.append(child)
    for r in running:
        row = pool.req_to_token[r.row]
        owners.append((row[r.cached_len:r.alloc_len] // page).unique().tolist())
        path, node = [], r.last_node
        while cache and node is not cache.root:
            path.insert(0, node.value)
            locks[node] += 1
            node = node.parent
        assert sum(map(len, path)) == r.cached_len
        if path:
            assert row[:r.cached_len].tolist() == [int(s) for v in path for s in v]
    pages = [p for group in owners for p in group]
    assert sorted(pages) == list(range(1, pool.num_pages + 1)), "a page lost or shared"
    assert all(node.lock_ref == n for node, n in locks.items()), "locks unbalanced"


@pytest.mark.parametrize("page_size, cache", [(1, True), (4, True), (4, False)])
def test_kv_manager_operations_keep_the_invariant_and_balance_the_locks(page_size, cache):
    rng = random.Random(page_size)
    kv = kv_manager(page_size, num_tokens=96, cache=cache)
    system = ids(5, 12)
    running, finished = [], 0
    for _ in range(400):
        op, r = rng.random(), None
        if op < 0.3:  # admit a request, maybe with the shared system prompt
            r = kv_req((system if rng.random() < 0.6 else []) + ids(rng.randrange(99), 9))
            prefix = kv.match(r)
            n = rng.randint(1, r.seq_len - len(prefix.slots))
            if kv.admit(r, prefix, n):
                assert (r.kv_len, r.alloc_len - r.kv_len) == (len(prefix.slots), n)
                kv.computed([], [(r, n)])
                running.append(r)
            else:
                assert r.row is None and r.last_node is None
                r = None
        elif op < 0.6 and running:  # a prompt chunk of one request
            r = rng.choice(running)
            if r.prefilling:
                n, before = rng.randint(1, r.seq_len - r.kv_len), r.kv_len
                if kv.grow(r, n):
                    kv.computed([], [(r, n)])
                    assert r.kv_len == r.alloc_len == before + n
        elif op < 0.8:  # a decode step of every decoding request, in one go
            decodes = [r for r in running if not r.prefilling]
            if kv.ensure_free(kv.decode_slots_needed(decodes)):
                kv.grow_decodes(decodes)
                kv.computed(decodes, [])
                for r in decodes:
                    assert r.kv_len == r.alloc_len == r.seq_len
                    r.append_token(rng.randrange(3, 500))
            r = None
        elif running:  # finish (the prefix stays cached) or retract (nothing cached)
            r = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.7:
                kv.release(r)
            else:
                kv.retract(r)
            assert (r.row, r.last_node, r.kv_len, r.alloc_len, r.cached_len) == (None, None, 0,
                                                                                   0, 0)
            finished += 1
            r = None
        if r is not None and r.kv_len == r.seq_len:  # its K/V is complete: sample a token
            r.append_token(rng.randrange(3, 500))
        assert_kv_consistent(kv, running)
    assert finished > 20
    for r in running:
        kv.release(r)
    assert_kv_consistent(kv, [])
    assert kv.cache is None or (kv.cache.protected_size == 0 and kv.cache.flush())
    assert kv.pool.free_slots == kv.pool.size and kv.pool.free_reqs == kv.pool.max_reqs


def test_kv_manager_admit_is_all_or_nothing():
    kv = kv_manager(num_tokens=32, max_reqs=2)
    a = kv_req(ids(1, 21))
    assert kv.admit(a, kv.match(a), 20)
    kv.computed([], [(a, 20)])
    kv.release(a)  # its 20 tokens stay cached, unlocked
    c = kv_req(ids(9, 5))
    assert kv.admit(c, kv.match(c), 5) and kv.pool.free_slots == 7
    b = kv_req(ids(1, 20) + ids(2, 11))
    prefix = kv.match(b)
    assert len(prefix.slots) == 20
    assert kv.available() == 7 + 20
    assert kv.available(prefix.node) == 7  # admitting b protects its prefix from eviction
    # 10 more slots only fit by evicting b's own prefix: refused, holding no row and no lock
    assert not kv.admit(b, prefix, 10)
    assert (b.row, b.last_node, b.alloc_len) == (None, None, 0)
    assert kv.cache.protected_size == 0 and kv.cache.total_size == 20
    assert kv.pool.free_reqs == 1 and kv.pool.free_slots == 7
    d = kv_req(ids(3, 3))
    assert kv.admit(d, kv.match(d), 2)  # the last row
    e = kv_req(ids(1, 20) + ids(4, 2))
    assert not kv.admit(e, kv.match(e), 1)  # no row: nothing taken, nothing locked
    assert e.row is None and kv.cache.protected_size == 0 and kv.pool.free_slots == 5
    assert_kv_consistent(kv, [c, d])


def test_kv_manager_frees_a_prompt_computed_twice_and_shares_the_trees_copy():
    kv = kv_manager()
    prompt = ids(4, 17)
    a, b = kv_req(prompt), kv_req(prompt)
    for r in (a, b):  # both admitted before either is cached: each computes all 16 tokens
        assert kv.admit(r, kv.match(r), 16)
    kv.computed([], [(a, 16), (b, 16)])
    table = kv.pool.req_to_token
    assert table[b.row, :16].tolist() == table[a.row, :16].tolist()  # b now reads a's slots
    assert a.last_node is b.last_node and a.last_node.lock_ref == 2
    assert kv.pool.free_slots == kv.pool.size - 16  # b's 16 duplicates went back to the pool
    assert_kv_consistent(kv, [a, b])
    kv.retract(b)
    kv.release(a)
    assert_kv_consistent(kv, [])
    assert kv.cache.total_size == 16 and kv.cache.protected_size == 0


def verdicts_of_first_step(engine, prompts, **params):
    """The admission verdicts of the first step, in the order requests were tried."""
    s, seen = engine.scheduler, []
    try_admit = s._try_admit
    s._try_admit = lambda *a: seen.append(try_admit(*a)) or seen[-1]
    for p in prompts:
        engine.add_request(p, {**GREEDY, "max_new_tokens": 3, **params})
    engine.step()
    del s._try_admit
    while s.has_work:
        engine.step()
    s.check_invariants()
    return [v.name for v in seen]


@pytest.mark.parametrize("kw, prompts, params, expected", [
    ({"max_running_requests": 2}, [ids(1, 8), ids(2, 8), ids(3, 8)], {},
     ["ADMITTED", "ADMITTED", "BATCH_FULL"]),
    ({"chunked_prefill_size": 16}, [ids(1, 40), ids(2, 8)], {}, ["CHUNKED"]),
    ({"chunked_prefill_size": 16}, [ids(1, 16), ids(2, 8)], {}, ["ADMITTED", "NO_BUDGET"]),
    ({}, [ids(1, 10)], {"n": 2}, ["ADMITTED", "WAITS"]),  # the 2nd sample waits for the 1st
    ({}, [ids(1, 40) + [5], ids(1, 40) + [6]], {}, ["ADMITTED", "WAITS"]),  # in-batch prefix
    ({"max_total_tokens": 200}, [ids(1, 50), ids(2, 50)], {"max_new_tokens": 100},
     ["ADMITTED", "NO_ROOM"]),  # 200 - 50 - 0.7 x 100 reserved < 50 + 0.7 x 100
])
def test_admission_verdicts_say_why_a_request_was_not_admitted(model, kw, prompts, params,
                                                                expected):
    engine = make(model, **kw)
    assert verdicts_of_first_step(engine, prompts, **params) == expected
    assert_all_free(engine)
