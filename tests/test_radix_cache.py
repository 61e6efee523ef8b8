"""RadixCache: insert tells the caller what the tree holds; room is read without locking."""

from __future__ import annotations

import random

import pytest
import torch

from engine.memory.radix_cache import RadixCache


def cache(page_size=1):
    freed = []
    c = RadixCache(lambda slots: freed.append(slots.tolist()), page_size)
    return c, freed


def slots(start, n):
    return torch.arange(start, start + n, dtype=torch.int32)


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_returns_the_duplicates_the_end_node_and_the_trees_slots(page_size):
    c, _ = cache(page_size)
    first = c.insert(list(range(8)), slots(100, 8))
    assert first.cached == 0 and first.slots.tolist() == list(range(100, 108))
    # the same first 4 tokens under other slots, then 4 new ones
    key = list(range(4)) + [50, 51, 52, 53]
    second = c.insert(key, slots(200, 8))
    assert second.cached == 4  # the caller frees its slots 200..203: the tree keeps 100..103
    assert second.slots.tolist() == [100, 101, 102, 103, 204, 205, 206, 207]
    matched, node = c.match_prefix(key)
    assert node is second.node and matched.tolist() == second.slots.tolist()
    again = c.insert(key, slots(300, 8))  # all of it cached already
    assert again.cached == 8 and again.node is second.node
    assert again.slots.tolist() == second.slots.tolist()
    assert c.total_size == 12
    c.check_integrity()


def test_insert_ending_inside_a_node_splits_it_there():
    c, _ = cache()
    c.insert(list(range(10)), slots(0, 10))
    out = c.insert(list(range(6)), slots(50, 6))
    assert out.cached == 6 and out.slots.tolist() == list(range(6))
    assert out.node.key == tuple(range(6)) and out.node.parent is c.root
    c.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2])
def test_evictable_size_after_lock_is_what_locking_would_leave(page_size):
    rng = random.Random(page_size)
    c, _ = cache(page_size)
    nodes, used = [], 0
    for _ in range(30):
        n = page_size * rng.randint(1, 6)
        base = [rng.randrange(3) for _ in range(n)]  # few symbols: many shared prefixes
        nodes.append(c.insert(base, slots(used, n)).node)
        used += n
    locked = []
    for _ in range(60):
        node = rng.choice(nodes)
        expected_before = c.evictable_size
        predicted = c.evictable_size_after_lock(node)
        assert c.evictable_size == expected_before  # reading it locks nothing
        c.inc_lock(node)
        assert c.evictable_size == predicted
        locked.append(node)
        if rng.random() < 0.5:
            c.dec_lock(locked.pop(rng.randrange(len(locked))))
        c.check_integrity()
    assert c.evictable_size_after_lock(c.root) == c.evictable_size
    for node in locked:
        c.dec_lock(node)
    assert c.protected_size == 0


def test_locked_prefix_survives_eviction_and_flush_waits_for_it():
    c, freed = cache()
    kept = c.insert([1, 2, 3], slots(10, 3)).node
    c.insert([7, 8], slots(20, 2))
    c.inc_lock(kept)
    assert c.evict(100) == 2 and freed == [[20, 21]]
    assert not c.flush()  # a running request still uses [1, 2, 3]
    c.dec_lock(kept)
    assert c.flush() and c.total_size == 0
