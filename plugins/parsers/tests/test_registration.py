"""The plugin's names, as SGLang's and vLLM's flags spell them, in the registries; a factory
makes a fresh parser per request."""

from __future__ import annotations

import engine_parsers
import pytest
from engine.parsers import ReasoningParser, ToolParser
from engine.plugins import registries_with
from engine.registry import UnknownName


def test_registered_names_and_aliases():
    _, regs = registries_with(engine_parsers)
    assert regs.tool_parsers.names() == ["hermes", "llama3_json", "mistral", "pythonic"]
    for alias in ("qwen25", "llama3", "llama4_pythonic"):
        assert alias in regs.tool_parsers
    assert regs.reasoning_parsers.names() == ["deepseek-r1", "qwen3", "qwen3-thinking"]
    assert "deepseek_r1" in regs.reasoning_parsers
    tools = [{"type": "function", "function": {"name": "f"}}]
    for entry in regs.tool_parsers:
        parser = entry.obj(tools)
        assert isinstance(parser, ToolParser) and parser.names == {"f"}
        assert entry.obj(tools) is not parser
    for entry in regs.reasoning_parsers:
        assert isinstance(entry.obj(True), ReasoningParser)


def test_unknown_name_lists_the_installed_ones():
    _, regs = registries_with(engine_parsers)
    with pytest.raises(UnknownName, match="Did you mean 'hermes'.*Registered: hermes"):
        regs.tool_parsers.get("hermez")


def test_declares_the_hook_contract():
    assert engine_parsers.ENGINE_HOOKS_VERSION == "1.4"
