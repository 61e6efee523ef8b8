"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (and its reasoning
options) made into what the chat route needs: the tools for the chat template, the grammar that
``required`` or a named function is enforced with, and how each choice's output is read
(engine.server.chat_output).

- ``none``: the tools reach the template (as vLLM does), the output is content.
- ``auto`` (the default with tools): the server's ``--tool-call-parser`` reads the calls the
  model writes; without one, a 400 saying how to start the server.
- ``required``: the output is forced to a JSON array of ``{"name": ..., "parameters": {...}}``
  (one item without ``parallel_tool_calls``), each a tool's name and its parameters' schema.
- ``{"type": "function", "function": {"name": ...}}``: the output is forced to that
  function's arguments (its parameters' schema).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from engine.interfaces import Constraint
from engine.parsers import NamedCall, RequiredCalls
from engine.server.errors import bad_request

ANY_OBJECT = {"type": "object"}


@dataclass
class ChatTools:
    template_tools: list[dict] | None  # the ``tools`` the chat template gets
    constraint: Constraint | None  # required / a named function: what the grammar enforces
    tool_parser: Callable | None  # () -> ToolParser for one choice; None: no calls read
    reasoning_parser: Callable | None  # () -> ReasoningParser for one choice
    keep_special_tokens: bool  # a parser's markers are special tokens


def chat_tools(engine, body, other_constraint: Constraint | None) -> ChatTools:
    """What ``body``'s tool and reasoning fields ask of this ``engine``; a 400 for a request it
    cannot serve (``other_constraint``: the request's own structured-output field)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    names = [t["function"]["name"] for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise bad_request(f"tools: the function name {twice[0]!r} is given twice; names must be "
                          f"unique", param="tools", code="invalid_value")
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    named = None if isinstance(choice, str) else choice.function.name
    if not tools and (choice == "required" or named is not None):
        raise bad_request("tool_choice asks for a tool call, and the request has no tools",
                          param="tool_choice", code="invalid_value")
    if named is not None and named not in names:
        raise bad_request(f"tool_choice names the function {named!r}, which is not among the "
                          f"request's tools ({', '.join(names)})", param="tool_choice",
                          code="invalid_value")
    forced = choice == "required" or named is not None
    if forced and other_constraint is not None:
        raise bad_request(f"tool_choice and {other_constraint.field} both constrain the output: "
                          f"give at most one", param=other_constraint.field,
                          code="invalid_value")
    parser = None
    if forced:
        constraint = Constraint("json_schema", json.dumps(
            _required_schema(tools, body.parallel_tool_calls) if named is None
            else _parameters(tools[names.index(named)])), "tools")
        parser = (lambda: RequiredCalls(tools)) if named is None else \
            (lambda: NamedCall(tools, named))
    else:
        constraint = None
        if tools and choice == "auto":
            parser = _auto_parser(engine, tools)
    reasoning = _reasoning_parser(engine, body, thinking=constraint is None and
                                  other_constraint is None)
    # a factory (a parser class) may say its markers are special tokens, kept in the text
    keep = (parser is not None and not forced and _keeps(engine.tool_parser)) or (
        reasoning is not None and _keeps(engine.reasoning_parser))
    return ChatTools(tools or None, constraint, parser, reasoning, keep)


def _keeps(entry) -> bool:
    return bool(getattr(entry.obj, "keep_special_tokens", False))


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or ANY_OBJECT


def _required_schema(tools: list[dict], parallel: bool) -> dict:
    calls = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t["function"]["name"]]},
        "parameters": _parameters(t)}, "required": ["name", "parameters"],
        "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1,
              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _auto_parser(engine, tools: list[dict]) -> Callable:
    entry = engine.tool_parser
    if entry is None:
        from engine.plugins import get_registries

        installed = ", ".join(get_registries().tool_parsers.names()) or \
            "none: pip install ./plugins/parsers"
        raise bad_request(
            "tool_choice 'auto' (the default when tools are given) needs the server started "
            f"with --tool-call-parser NAME, the format the model writes its calls in "
            f"(installed: {installed}); or send tool_choice 'required', a named function "
            f"(enforced by the grammar backend), or 'none'", param="tool_choice",
            code="invalid_value")
    return lambda: entry.obj(tools)


def _reasoning_parser(engine, body, thinking: bool) -> Callable | None:
    entry = engine.reasoning_parser
    if entry is None or not body.separate_reasoning:
        return None
    kwargs = body.chat_template_kwargs or {}
    thinking = thinking and kwargs.get("enable_thinking", True) is not False
    return lambda: entry.obj(thinking)
