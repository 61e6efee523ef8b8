"""Tool calls and reasoning in a model's output, for the chat route: the parser interfaces that
plugins implement (``register_tool_parsers``, ``register_reasoning_parsers``; base.py), the
readers of JSON-written calls they share with the grammar-enforced ``tool_choice``
(calls.py, on the incremental JSON scanner of json_scan.py; forced.py: the calls of a
``tool_choice`` the grammar enforces) and what a response makes of a
tool parser's events (output.py). Nothing here imports torch."""

from engine.parsers.base import (
                                 Arguments,
                                 Content,
                                 Invalid,
                                 Name,
                                 ReasoningParser,
                                 ToolEvent,
                                 ToolParser,
                                 hold_back,
                                 tool_names,
)
from engine.parsers.calls import (
                                 ARGUMENT_KEYS,
                                 ArgumentsReader,
                                 CallError,
                                 CallListReader,
                                 CallReader,
                                 NotACall,
)
from engine.parsers.forced import NamedCall, RequiredCalls
from engine.parsers.json_scan import JsonScanner, JsonSyntaxError
from engine.parsers.output import ToolCall, ToolCalls

__all__ = [
    "ARGUMENT_KEYS", "Arguments", "ArgumentsReader", "CallError", "CallListReader", "CallReader",
    "Content", "Invalid", "JsonScanner", "JsonSyntaxError", "Name", "NamedCall", "NotACall",
    "ReasoningParser", "RequiredCalls", "ToolCall", "ToolCalls", "ToolEvent", "ToolParser",
    "hold_back", "tool_names",
]
