"""How the plugin registers (without needing the llguidance library): its name, its priority
below xgrammar's (the default where both are installed), and check()'s reason when the library
is missing."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

import engine_grammar_llguidance as plugin


def registered():
    calls = []
    plugin.register_grammar_backends(lambda *a, **kw: calls.append((a, kw)))
    return calls


def test_registers_llguidance_below_xgrammar():
    [((name, factory), kw)] = registered()
    assert name == "llguidance" and factory is plugin._factory
    assert kw["check"] is plugin.check and kw["priority"] == 10 and kw["description"]


def test_check_names_the_pip_command_when_the_library_is_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llguidance" else real(name, *a))
    assert plugin.check() == ("needs the llguidance library, which is not installed: "
                              "`pip install llguidance`")


def test_check_passes_where_the_library_is_installed():
    pytest.importorskip("llguidance", reason="the llguidance library is not installed")
    assert plugin.check() is None


def test_plugin_is_registered_through_its_entry_point():
    try:
        importlib.metadata.distribution("engine-grammar-llguidance")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("engine-grammar-llguidance is not installed: pip install -e "
                    "plugins/grammar_llguidance")
    from engine.plugins import get_registries

    entry = get_registries().grammar.get("llguidance")
    assert entry.dist == "engine-grammar-llguidance" and entry.extra["priority"] == 10
