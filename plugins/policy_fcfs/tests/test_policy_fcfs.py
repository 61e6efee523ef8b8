import json
from types import SimpleNamespace

from click.testing import CliRunner

from engine.plugins import get_registries
from engine_cli.main import cli


def test_plugin_is_installed():
    data = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).output)
    assert "engine-policy-fcfs" in {p["dist"] for p in data["plugins"]}


def test_registration_shape():
    entry = get_registries().policies.get("fcfs")
    assert entry.dist == "engine-policy-fcfs" and entry.extra["cache_aware"] is False


def test_orders_by_arrival_ignoring_prefix():
    policy = get_registries().policies.get("fcfs").obj(None)
    reqs = [SimpleNamespace(arrival=a, cached=c) for a, c in [(3, 100), (1, 0), (2, 50)]]
    assert [r.arrival for r in policy.order(reqs, lambda r: r.cached)] == [1, 2, 3]
