"""How the plugin registers (without needing the xgrammar library): its name, its priority
over llguidance (the default where installed), and check()'s reason when the library is missing."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

import engine_grammar_xgrammar as plugin


def registered():
    calls = []
    plugin.register_grammar_backends(lambda *a, **kw: calls.append((a, kw)))
    return calls


def test_registers_xgrammar_with_the_highest_priority():
    [((name, factory), kw)] = registered()
    assert name == "xgrammar" and factory is plugin._factory
    assert kw["check"] is plugin.check and kw["priority"] == 20 and kw["description"]


def test_check_names_the_pip_command_when_the_library_is_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xgrammar" else real(name, *a))
    assert plugin.check() == ("needs the xgrammar library, which is not installed: "
                              "`pip install xgrammar`")


def test_check_passes_where_the_library_is_installed():
    pytest.importorskip("xgrammar", reason="the xgrammar library is not installed")
    assert plugin.check() is None


def test_plugin_is_registered_through_its_entry_point():
    try:
        importlib.metadata.distribution("engine-grammar-xgrammar")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("engine-grammar-xgrammar is not installed: pip install -e "
                    "plugins/grammar_xgrammar")
    from engine.plugins import get_registries

    entry = get_registries().grammar.get("xgrammar")
    assert entry.dist == "engine-grammar-xgrammar" and entry.extra["priority"] == 20
