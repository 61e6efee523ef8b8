"""The hook contract's version: plugins built for an older or a newer contract are not loaded,
and `engine plugins` / `engine serve` say what they need and what this engine offers
(fixtures: tests/fixtures/contract_plugins, found through their dist-info, never installed)."""

import json
import os
import subprocess
import sys

import pytest

from engine import hookspecs
from engine.contract import contract_problem
from engine.plugins import (build_registries, load_entry_points, new_plugin_manager,
                            register_builtins)
from engine.registry import UnknownName

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                        "contract_plugins")
ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")


def test_same_major_and_older_minor_run_newer_or_other_majors_do_not(monkeypatch):
    monkeypatch.setattr(hookspecs, "ENGINE_HOOKS_VERSION", "1.2")
    for ok in (None, "1.0", "1.2"):  # undeclared is taken as 1.0
        assert contract_problem(ok) is None, ok
    assert contract_problem("1.3") == (
        "needs the engine hook contract 1.3, and this engine offers 1.2: upgrade the engine "
        "(pip install -U engine-core engine-cli), or install a release of the plugin built "
        "for 1.x, at most 1.2")
    assert "needs the engine hook contract 2.0, and this engine offers 1.2" in \
        contract_problem("2.0")
    assert contract_problem("0.9") == (
        "was built for the engine hook contract 0.9, and this engine offers 1.2, which no "
        "longer runs 0.x plugins: install a release of the plugin built for 1.x")
    for bad in ("1", "v1.0", "1.0.0", 1.0):
        assert f"declares ENGINE_HOOKS_VERSION = {bad!r}, which is not a hook contract " \
               f"version" in contract_problem(bad)


def test_mismatched_plugins_are_not_registered_and_their_names_say_why(monkeypatch):
    monkeypatch.syspath_prepend(FIXTURES)
    pm, infos = new_plugin_manager(), {}
    register_builtins(pm, infos)
    load_entry_points(pm, infos)
    pm.check_pending()  # the newer plugin's unknown hook would fail here if it were registered
    assert not pm.has_plugin("older_plugin") and not pm.has_plugin("newer_plugin")
    older, newer = infos["older_plugin"], infos["newer_plugin"]
    assert (older.hooks_version, newer.hooks_version) == ("0.9", "2.0")
    assert older.incompatible.startswith("was built for the engine hook contract 0.9")
    assert newer.incompatible.startswith("needs the engine hook contract 2.0")
    assert older.withheld == {"policies": ["older_policy"], "attention": ["older_attention"]}
    regs = build_registries(pm, infos)
    assert "newer_policy" not in regs.policies and "older_attention" not in regs.attention
    with pytest.raises(UnknownName) as err:
        regs.policies.get("newer_policy")
    assert str(err.value) == (
        "schedule policy 'newer_policy' is provided by engine-newer-plugin 0.2.0, which is not "
        f"loaded: it {newer.incompatible}.")
    with pytest.raises(UnknownName, match="'older_attention' is provided by engine-older-plugin "
                                          "0.3.0, which is not loaded: it was built for"):
        regs.attention.get("older_attention")
    with pytest.raises(UnknownName, match="Did you mean 'lifo'"):  # others: as before
        regs.policies.get("lifx")


def run_engine(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [FIXTURES, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([ENGINE, *args], capture_output=True, text=True, env=env, timeout=120)


def test_engine_plugins_shows_what_each_needs_and_what_this_engine_offers():
    out = run_engine("plugins")
    assert out.returncode == 0, out.stderr
    offered = hookspecs.ENGINE_HOOKS_VERSION
    assert (f"Not loaded (built for another hook contract; this engine offers {offered}):\n"
            f"  engine-newer-plugin 0.2.0 (plugin newer_plugin): needs the engine hook contract "
            f"2.0, and this engine offers {offered}") in out.stdout
    assert ("  engine-older-plugin 0.3.0 (plugin older_plugin): was built for the engine hook "
            "contract 0.9") in out.stdout
    data = json.loads(run_engine("plugins", "--json").stdout)
    assert data["hooks_version"] == offered
    by_dist = {e["dist"]: e for e in data["incompatible"]}
    assert by_dist["engine-newer-plugin"]["hooks_version"] == "2.0"
    assert by_dist["engine-newer-plugin"]["names"] == {"policies": ["newer_policy"]}
    assert "newer_policy" not in [p["name"] for p in data["policies"]]
    assert not [e for e in data["errors"] if e["dist"] == "engine-newer-plugin"]


def test_engine_serve_naming_a_withheld_name_says_why():
    out = run_engine("serve", "--schedule-policy", "newer_policy")
    assert out.returncode == 2
    assert ("schedule policy 'newer_policy' is provided by engine-newer-plugin 0.2.0, which is "
            "not loaded: it needs the engine hook contract 2.0") in out.stderr
