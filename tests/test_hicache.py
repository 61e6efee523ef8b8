"""HiCache (--enable-hierarchical-cache): the host tier and the file storage tier under the
radix cache. Greedy outputs are identical with the tiers on and off, prefixes come back from
host memory, from disk, after a restart and from another engine sharing the directory, bad
page files are refused, and every tier's slot accounting holds after every step."""

import glob
import logging
import os
import random

import pytest
from engine import Engine
from engine.config import ConfigError
from engine.hicache.settings import STORAGE_PAGE_TOKENS
from engine_testing.invariants import assert_all_free, run_checked

GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def prompts(n=6, length=140, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, 250) for _ in range(length)] for _ in range(n)]


def run(engine, ps, params=GREEDY):
    """Each prompt in turn (so earlier ones are evicted), invariants checked every step;
    returns (outputs, cached tokens)."""
    outs, cached = [], []
    for p in ps:
        [r] = engine.add_request(p, params)
        run_checked(engine, [r])
        outs.append(r.output_ids)
        cached.append(r.cached_tokens)
    return outs, cached


def hicache(model, tmp_path=None, **kw):
    args = dict(max_total_tokens=320, enable_hierarchical_cache=True, enable_cache_report=True)
    if tmp_path is not None:
        args.update(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                    hicache_storage_prefetch_policy="wait_complete")
    args.update(kw)
    return Engine(model, **args)


@pytest.fixture(scope="module")
def reference(model):
    ps = prompts()
    return ps, run(Engine(model, max_total_tokens=320), ps)[0]


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("storage", [False, True])
def test_outputs_identical_with_tiers_on_and_off(model, reference, policy, storage, tmp_path):
    ps, ref = reference
    engine = hicache(model, tmp_path if storage else None, hicache_write_policy=policy,
                     hicache_ratio=3)
    # each prompt twice in a row (a device hit: write_through_selective's second hit), then
    # all again: by then evicted from the device pool (320 tokens)
    order = [i for i in range(len(ps)) for _ in range(2)] + list(range(len(ps)))
    outs, cached = run(engine, [ps[i] for i in order])
    assert outs == [ref[i] for i in order]
    stats = engine.scheduler.kv.stats
    assert stats.hits["host"] > 0 and sum(cached[-len(ps):]) > 0
    engine.close()
    assert_all_free(engine)


@pytest.mark.parametrize("policy,storage", [("write_through", False),
                                            ("write_through_selective", False),
                                            ("write_back", False), ("write_through", True)])
def test_the_overlap_scheduler_backs_up_only_what_its_worker_wrote(model, reference, policy,
                                                                 storage, tmp_path):
    """--enable-overlap-schedule: a prefix enters the tree when its batch is submitted and the
    worker writes its K/V later, so its host copy waits for that batch (deferred backups); the
    outputs are those without tiers, one request at a time and all of them at once."""
    ps, ref = reference
    engine = hicache(model, tmp_path if storage else None, hicache_write_policy=policy,
                     hicache_ratio=3, enable_overlap_schedule=True)
    order = [i for i in range(len(ps)) for _ in range(2)] + list(range(len(ps)))
    outs, cached = run(engine, [ps[i] for i in order])
    assert outs == [ref[i] for i in order]
    assert engine.scheduler.kv.stats.hits["host"] > 0 and sum(cached[-len(ps):]) > 0
    reqs = [r for p in ps for r in engine.add_request(p, GREEDY)]  # a batch, in flight
    run_checked(engine, reqs)
    assert [r.output_ids for r in reqs] == ref
    tree = engine.scheduler.kv.cache
    assert tree.submitted > 0 and tree.written == tree.submitted and not tree._deferred
    engine.close()
    assert_all_free(engine)


def test_overlap_with_every_request_kind(model):
    """HiCache under the overlap scheduler beside echo + prompt logprobs, seeded n > 1 and a
    grammar, with prompts evicted to the host and loaded back: what the overlap scheduler
    gives without tiers."""
    from engine.interfaces import Constraint

    ps = prompts(4, 120, seed=7)
    kinds = [({**GREEDY, "logprobs": True}, {"prompt_logprobs": 2}),
             ({"temperature": 1.0, "seed": 3, "n": 2, "max_new_tokens": 8}, {}),
             ({"temperature": 0.9, "seed": 4, "max_new_tokens": 8},
              {"constraint": Constraint("regex", "(ab|cd)+x", "regex")}),
             (GREEDY, {})]

    def serve(engine):
        out = []
        for _ in range(2):  # the second pass finds the first's prompts in the host tier
            for p, (params, extra) in zip(ps, kinds):
                reqs = engine.add_request(p, params, **extra)
                run_checked(engine, reqs)
                out.append([(r.output_ids, [round(x, 3) for x in r.output_logprobs],
                             [None if x is None else round(x, 3) for x in r.input_logprobs])
                            for r in reqs])
        return out

    ref = serve(Engine(model, max_total_tokens=320, enable_overlap_schedule=True))
    engine = hicache(model, hicache_ratio=3, enable_overlap_schedule=True)
    assert serve(engine) == ref
    assert engine.scheduler.kv.stats.hits["host"] > 0
    engine.close()
    assert_all_free(engine)


@pytest.mark.parametrize("policy,ranks", [("write_through", {"tp_size": 2}),
                                          ("write_back", {"tp_size": 2}),
                                          ("write_through", {"pp_size": 2})])
def test_every_rank_keeps_its_own_host_tier(model, reference, policy, ranks):
    """--tp-size / --pp-size 2: each rank's pool holds a shard of the K/V, so each keeps its
    own host tier; rank 0's copies go to the others with the next batch and are made there
    before its forward. Prefixes evicted to the host and loaded back give the outputs without
    tiers; the storage tier is refused with ranks."""
    ps, ref = reference
    engine = hicache(model, hicache_write_policy=policy, hicache_ratio=3, **ranks)
    order = [i for i in range(len(ps)) for _ in range(2)] + list(range(len(ps)))
    outs, cached = run(engine, [ps[i] for i in order])
    assert outs == [ref[i] for i in order]
    stats = engine.scheduler.kv.stats
    assert stats.hits["host"] > 0 and stats.bytes["host->device"] > 0
    engine.close()


@pytest.mark.parametrize("ranks", [{"tp_size": 2}, {"pp_size": 2}])
def test_every_rank_stores_its_own_shard(model, tmp_path, ranks, caplog):
    """The storage tier with ranks: each rank writes its shard of a page (rank 1 under the key
    + "-r1"); a prefix evicted from the device and host tiers comes back from disk on both
    ranks, after a restart too, with the outputs of one process; a page whose rank-1 shard is
    damaged is refused as a whole (logged), and pages of another layout are not found."""
    [p] = prompts(1, 200, seed=2)
    [ref] = run(Engine(model, max_total_tokens=320), [p])[0]
    key = len(p) - 1
    stored = key - key % STORAGE_PAGE_TOKENS
    engine = hicache(model, tmp_path, **ranks)
    assert run(engine, [p])[0] == [ref]
    tree, stats = engine.scheduler.kv.cache, engine.scheduler.kv.stats
    tree.drain()  # its host copy landed: its pages are queued for storage on both ranks
    tree.evict(tree.total_size)
    tree.evict_host(tree.host_size)  # only the disk has it now: both ranks' shards
    outs, cached = run(engine, [p])
    assert outs == [ref] and cached == [stored]
    assert stats.hits["storage"] == stored
    engine.close()  # writes every rank's queued pages
    mine = sorted(glob.glob(str(tmp_path / "*.kvpage")))
    shards = [f for f in mine if f.endswith("-r1.kvpage")]
    assert len(shards) == len(mine) - len(shards) == stored // STORAGE_PAGE_TOKENS

    restarted = hicache(model, tmp_path, **ranks)
    assert run(restarted, [p]) == ([ref], [stored])
    restarted.close()

    # one process, another layout: its own keys, nothing of the ranks' found
    single = hicache(model, tmp_path)
    assert run(single, [p]) == ([ref], [0])
    single.close()

    first = min(shards, key=lambda f: os.path.getmtime(f))  # the first page's rank-1 shard
    with open(first, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    damaged = hicache(model, tmp_path, **ranks)
    with caplog.at_level(logging.WARNING, logger="engine"):
        outs, cached = run(damaged, [p])
    assert outs == [ref] and cached[0] < stored
    assert "-r1 ignored, not loaded: corrupt" in caplog.text
    damaged.close()
    assert_all_free(damaged)


def test_page_size_4_and_a_batch_at_once(model, tmp_path):
    ps = prompts(8, 90, seed=1)
    ref = [o["output_ids"] for o in Engine(model, max_total_tokens=400, page_size=4).generate(
        input_ids=ps * 2, sampling_params=GREEDY)]
    engine = hicache(model, tmp_path, max_total_tokens=400, page_size=4)
    reqs = [r for p in ps * 2 for r in engine.add_request(p, GREEDY)]
    run_checked(engine, reqs)
    assert [r.output_ids for r in reqs] == ref
    engine.close()
    assert_all_free(engine)


def test_a_prefix_evicted_from_the_device_comes_back_from_host_then_disk_then_restart(
        model, tmp_path):
    [p] = prompts(1, 200, seed=2)
    engine = hicache(model, tmp_path)
    ref, _ = run(engine, [p])
    tree, stats = engine.scheduler.kv.cache, engine.scheduler.kv.stats
    key = len(p) - 1  # the last token always runs

    tree.evict(tree.total_size)  # out of the device pool: kept in host memory
    engine.scheduler.check_invariants()
    assert tree.total_size == 0 and tree.host_size >= key
    before = dict(stats.hits)
    outs, cached = run(engine, [p])
    assert outs == ref and cached == [key]
    assert stats.hits["host"] - before["host"] == key

    tree.evict(tree.total_size)
    tree.evict_host(tree.host_size)  # out of host memory too: only the disk has it
    engine.scheduler.check_invariants()
    assert tree.host_size == 0 and tree.total_size == 0
    before = dict(stats.hits)
    outs, cached = run(engine, [p])
    stored = key - key % STORAGE_PAGE_TOKENS  # whole storage pages
    assert outs == ref and cached == [stored]
    assert stats.hits["storage"] - before["storage"] == stored
    engine.close()

    restarted = hicache(model, tmp_path)  # a new engine: only the directory is left
    outs, cached = run(restarted, [p])
    assert outs == ref and cached[0] == stored and stored >= 0.9 * key
    assert restarted.scheduler.kv.stats.bytes["storage->device"] > 0
    restarted.close()
    assert_all_free(restarted)


def test_two_engines_share_one_storage_directory(model, tmp_path):
    ps = prompts(3, 130, seed=3)
    a = hicache(model, tmp_path)
    b = hicache(model, tmp_path)
    ref, _ = run(a, ps)
    a.scheduler.kv.cache.storage.flush_writes()
    outs, cached = run(b, ps)
    assert outs == ref and cached == [128] * 3
    a.close()
    b.close()


def _damage(tmp_path, how):
    files = sorted(glob.glob(os.path.join(tmp_path, "*.kvpage")))
    assert files
    for f in files:
        data = open(f, "rb").read()
        if how == "truncated":
            data = data[: len(data) - 100]
        elif how == "corrupt":
            data = data[:-10] + bytes(b ^ 0xFF for b in data[-10:])
        open(f, "wb").write(data)
    return files


@pytest.mark.parametrize("how", ["truncated", "corrupt", "foreign"])
def test_bad_page_files_are_logged_and_never_loaded(model, tmp_path, caplog, how):
    [p] = prompts(1, 140, seed=4)
    writer = hicache(model, tmp_path, **({"kv_cache_dtype": "bf16"} if how == "foreign" else {}))
    ref, _ = run(writer, [p])
    writer.close()
    if how != "foreign":
        _damage(tmp_path, how)
    else:  # another dtype's pages, renamed to the keys this engine reads
        reader = hicache(model, tmp_path)
        storage = reader.scheduler.kv.cache.storage
        ours = storage.keys(None, p, len(p) // STORAGE_PAGE_TOKENS)
        theirs = sorted(glob.glob(os.path.join(tmp_path, "*.kvpage")))
        for key, f in zip(ours, theirs):
            os.replace(f, os.path.join(tmp_path, f"{key}.kvpage"))
        reader.close()
    engine = hicache(model, tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine"):
        outs, cached = run(engine, [p])
    if how != "foreign":
        assert outs == ref
    assert cached == [0]
    assert engine.scheduler.kv.stats.storage_rejected == 1
    why = {"truncated": "truncated", "corrupt": "corrupt", "foreign": "another model"}[how]
    assert any("ignored, not loaded" in r.message and why in r.message for r in caplog.records)
    engine.close()
    assert_all_free(engine)


def test_flags_are_checked(model):
    with pytest.raises(ConfigError, match="--enable-hierarchical-cache"):
        Engine(model, hicache_ratio=4)
    with pytest.raises(ConfigError, match="--disable-radix-cache"):
        Engine(model, enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ConfigError, match="write-policy"):
        Engine(model, enable_hierarchical_cache=True, hicache_write_policy="sometimes")
    with pytest.raises(ConfigError, match="storage-backend"):
        Engine(model, enable_hierarchical_cache=True,
               hicache_storage_prefetch_policy="wait_complete")
    with pytest.raises(Exception, match="nosuch"):
        Engine(model, enable_hierarchical_cache=True, hicache_storage_backend="nosuch")


def test_cache_report_lines(model, tmp_path, caplog):
    ps = prompts(2, 100, seed=5)
    engine = hicache(model, tmp_path, decode_log_interval=2)
    with caplog.at_level(logging.INFO, logger="engine"):
        run(engine, ps * 2)
    text = "\n".join(r.message for r in caplog.records)
    assert "#cached-token: 99 (device 99, host 0, storage 0)" in text
    assert "Cache report. hit rate:" in text and "storage->device" in text
    engine.close()


def test_the_multi_turn_workload_appends_each_turn_to_the_last():
    import random as _random

    from engine.bench.workloads import multi_turn_requests

    reqs = multi_turn_requests(list(range(10, 99)), 3, 4, 5, 2, _random.Random(0))
    assert len(reqs) == 12 and [r.group for r in reqs[:3]] == [0, 1, 2]  # turn-major
    for c in range(3):
        turns = [r.prompt for r in reqs if r.group == c]
        assert [len(t) for t in turns] == [5, 12, 19, 26]
        assert all(b[: len(a)] == a for a, b in zip(turns, turns[1:]))
