"""The --router-policy built-ins and the prefix tree, on fake replicas (no server)."""

from __future__ import annotations

import pytest

from engine.builtins.routing_policies import CacheAware, RoundRobin, ShortestQueue
from engine.router.policy import ReplicaView, RouterOptions
from engine.router.prefix_tree import PrefixTree


def views(*loads):
    return [ReplicaView(rank, load) for rank, load in enumerate(loads)]


def test_registered_through_the_hook(registries):
    assert {"round_robin", "shortest_queue", "cache_aware"} <= set(registries.routing.names())
    assert registries.routing.get("cache_aware").obj is CacheAware


def test_round_robin_cycles_over_the_live_replicas():
    policy = RoundRobin(RouterOptions(3))
    assert [policy.choose("x", views(0, 0, 0)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    live = [ReplicaView(0, 0), ReplicaView(2, 0)]  # rank 1 died
    assert {policy.choose("x", live) for _ in range(4)} == {0, 2}


def test_shortest_queue_picks_the_least_loaded():
    policy = ShortestQueue(RouterOptions(3))
    assert policy.choose("x", views(5, 2, 7)) == 1
    assert policy.choose("x", views(3, 3, 3)) == 0  # a tie: the lowest rank


def test_cache_aware_follows_the_longest_prefix_while_balanced():
    policy = CacheAware(RouterOptions(2))
    system_a, system_b = "You are a pirate. " * 10, "You are a lawyer. " * 10
    first_a = policy.choose(system_a + "hi", views(0, 0))
    first_b = policy.choose(system_b + "hi", views(0, 0))
    assert first_a != first_b  # a new prefix goes to the replica with the smaller tree
    for q in ("what is rum?", "sing", "where is the ship?"):
        assert policy.choose(system_a + q, views(1, 1)) == first_a
        assert policy.choose(system_b + q, views(1, 1)) == first_b


def test_cache_aware_below_the_cache_threshold_goes_to_the_smallest_tree():
    policy = CacheAware(RouterOptions(2, cache_threshold=0.5))
    policy.choose("a" * 100, views(0, 0))  # rank 0 now holds 100 chars
    # matches 10 of 100 chars of rank 0's tree: below the threshold, so rank 1 (empty tree)
    assert policy.choose("a" * 10 + "b" * 90, views(0, 0)) == 1


@pytest.mark.parametrize("loads, expected", [
    ((10, 0), 1),  # 10 - 0 > 4 and 10 > 0 * 1.5: imbalanced, the least loaded
    ((10, 7), 0),  # 10 - 7 = 3: within the absolute threshold, the cache wins
    ((30, 21), 0),  # 9 > 4 but 30 < 21 * 1.5: within the relative threshold, the cache wins
    ((0, 10), 0),  # the cached replica is the least loaded anyway
])
def test_cache_aware_balances_past_both_thresholds(loads, expected):
    policy = CacheAware(RouterOptions(2, balance_abs_threshold=4, balance_rel_threshold=1.5))
    prompt = "shared prefix " * 20
    assert policy.choose(prompt, views(0, 0)) == 0  # rank 0 now holds the prefix
    assert policy.choose(prompt + "q", views(*loads)) == expected


def test_cache_aware_forgets_a_dead_replica():
    policy = CacheAware(RouterOptions(2))
    prompt = "p" * 50
    home = policy.choose(prompt, views(0, 0))
    policy.remove(home)
    assert policy.tree.match(prompt) == {}
    assert policy.choose(prompt, [ReplicaView(1 - home, 0)]) == 1 - home


def test_prefix_tree_matches_and_evicts_least_recently_used():
    tree = PrefixTree(max_chars=10)
    tree.insert("abcdef", 0)
    tree.insert("abxy", 1)
    assert tree.match("abcdzz") == {0: 4, 1: 2}
    tree.insert("ghij", 0)  # rank 0 holds 10 chars: at the cap
    assert tree.size[0] == 10
    tree.match("ghij")  # used more recently than "abcdef"
    tree.insert("klm", 0)  # 13 > 10: the 3 least recently used leaf chars of rank 0 go
    assert tree.size[0] == 10
    assert tree.match("abcdef")[0] == 3 and tree.match("ghij")[0] == 4
    assert tree.match("abxy")[1] == 4  # rank 1's share is untouched


@pytest.mark.parametrize("kwargs, message", [
    ({"dp_size": 0}, "--dp-size must be >= 1"),
    ({"dp_size": 2, "balance_rel_threshold": 0.5}, "--router-balance-rel-threshold"),
    ({"dp_size": 2, "cache_threshold": 2.0}, "--router-cache-threshold"),
])
def test_router_options_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RouterOptions(**kwargs).validate()


def test_an_outside_plugin_registers_a_routing_policy():
    from engine.hookspecs import hookimpl
    from engine.plugins import build_registries, new_plugin_manager, register_builtins
    from engine.registry import DuplicateRegistration

    class LowestRank:
        def __init__(self, options):
            pass

        def choose(self, text, replicas):
            return min(r.rank for r in replicas)

        def remove(self, rank):
            pass

    class Plugin:
        def __init__(self, name):
            self.name = name

        @hookimpl
        def register_routing_policies(self, register):
            register(self.name, LowestRank, description="always the lowest live rank")

    pm, infos = new_plugin_manager(), {}
    register_builtins(pm, infos)
    pm.register(Plugin("lowest_rank"), name="mine")
    regs = build_registries(pm, infos)
    entry = regs.routing.get("lowest_rank")
    assert entry.plugin == "mine" and infos["mine"].registered == {"routing": ["lowest_rank"]}
    assert entry.obj(RouterOptions(2)).choose("x", views(3, 1)) == 0

    pm.register(Plugin("round_robin"), name="clash")
    with pytest.raises(DuplicateRegistration, match="round_robin"):
        build_registries(pm, {})


def _check_tree(tree: PrefixTree) -> None:
    """The tree's bookkeeping against a walk of it: sizes, node counts, child counts, and
    that a node holding a replica has a parent holding it."""
    size, nodes = {}, {}
    stack = [tree.root]
    while stack:
        node = stack.pop()
        below = {}
        for first, child in node.children.items():
            assert child.edge and child.edge[0] == first and child.parent is node
            assert child.last_used, "a node held by no replica stays in the tree"
            for r in child.last_used:
                below[r] = below.get(r, 0) + 1
                assert node is tree.root or r in node.last_used
            stack.append(child)
        assert below == node.below
        for r in node.last_used:
            size[r] = size.get(r, 0) + len(node.edge)
            nodes[r] = nodes.get(r, 0) + 1
    assert {r: s for r, s in tree.size.items() if s} == size
    assert {r: n for r, n in tree.nodes.items() if n} == nodes


def test_prefix_tree_bookkeeping_holds_under_random_traffic():
    import random

    rng = random.Random(1)
    tree = PrefixTree(max_chars=300, max_prefix=40)
    heads = ["".join(rng.choices("abc", k=rng.randint(1, 12))) for _ in range(6)]
    for i in range(3000):
        text = rng.choice(heads) + "".join(rng.choices("abcd", k=rng.randint(0, 30)))
        if rng.random() < 0.3:
            tree.match(text)
        else:
            tree.insert(text, rng.randrange(3))
            assert all(s <= 300 for s in tree.size.values())
        if i % 500 == 499:
            tree.remove(rng.randrange(3))
        if i % 50 == 0:
            _check_tree(tree)
    _check_tree(tree)
    # what a replica still holds, it matches in full
    tree.insert("abcabcabc", 0)
    assert tree.match("abcabcabc")[0] == 9


def test_routing_cost_per_request_does_not_grow_with_the_requests_routed():
    """Issue 28: eviction walked the whole tree on every insert once a replica's share was full
    (1.7 ms rising to 141 ms a request). Counted in tree nodes touched, not in time."""
    import random
    import string

    rng = random.Random(0)
    policy = CacheAware(RouterOptions(4))
    policy.tree.max_chars = 20_000
    systems = ["".join(rng.choices(string.ascii_letters, k=300)) for _ in range(8)]

    def window(n):
        before = policy.tree.visits
        for _ in range(n):
            policy.choose(rng.choice(systems) + "".join(rng.choices(string.ascii_letters, k=300)),
                          views(0, 0, 0, 0))
        return (policy.tree.visits - before) / n

    window(400)  # every share is full from here on
    assert all(s == 20_000 for s in policy.tree.size.values())
    early = window(300)
    for _ in range(4):
        window(300)
    late = window(300)
    assert late <= 2 * early + 2 and late < 30, (early, late)


def test_a_huge_prompt_costs_its_capped_prefix_only():
    import tracemalloc

    policy = CacheAware(RouterOptions(2))
    huge, other = "x" * (32 << 20), "x" * (32 << 20) + "y"  # 32 MiB: once 15 GiB of tree
    tracemalloc.start()
    try:
        first = policy.choose(huge, views(0, 0))
        assert policy.choose(other, views(0, 0)) == first  # the cache still routes
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert policy.tree.size[first] == policy.tree.max_prefix
    assert sum(policy.tree.nodes.values()) == 1
