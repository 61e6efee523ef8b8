import json
from types import SimpleNamespace

from click.testing import CliRunner

from engine.plugins import get_registries
from engine_cli.main import cli
from engine_policy_lpm.policy import FCFS_FALLBACK_QUEUE_LEN


def test_plugin_is_installed():
    data = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).output)
    assert "engine-policy-lpm" in {p["dist"] for p in data["plugins"]}


def test_registration_shape():
    entry = get_registries().policies.get("lpm")
    assert entry.dist == "engine-policy-lpm" and entry.extra["cache_aware"] is True


def test_orders_by_longest_cached_prefix_then_arrival():
    policy = get_registries().policies.get("lpm").obj(None)
    reqs = [SimpleNamespace(arrival=a, cached=c) for a, c in [(1, 0), (2, 50), (3, 100), (4, 50)]]
    assert [r.arrival for r in policy.order(reqs, lambda r: r.cached)] == [3, 2, 4, 1]


def test_long_queue_falls_back_to_arrival_order():
    policy = get_registries().policies.get("lpm").obj(None)
    n = FCFS_FALLBACK_QUEUE_LEN + 1
    reqs = [SimpleNamespace(arrival=i, cached=i) for i in range(n)]
    assert [r.arrival for r in policy.order(reqs, lambda r: r.cached)] == list(range(n))
