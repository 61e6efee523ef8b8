"""What the plugins of ``register_tool_parsers`` and ``register_reasoning_parsers`` implement.

A parser is made per choice of a chat response and reads the model's output text as it comes
(``feed`` gets the text deltas in order, ``finish`` is called once at the end); the server uses
the same instance whether it streams or not, so a response reads the same either way. A streamed
delta may end inside a marker (``<tool_call`` of ``<tool_call>``): a parser holds such a tail
back (``hold_back``) until the next delta, or ``finish``, resolves it, and never hands markup on
as content.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass


# -- what a tool parser reports -------------------------------------------------------------------
@dataclass(frozen=True)
class Content:
    """Text of the answer (not a call)."""

    text: str


@dataclass(frozen=True)
class Name:
    """Call ``call`` (the parser's own numbering) is to the function ``name``: reported once its
    name is complete and is one of the request's tools, before any of its arguments."""

    call: int
    name: str


@dataclass(frozen=True)
class Arguments:
    """More of call ``call``'s arguments: the text of a JSON object, as written so far."""

    call: int
    text: str


@dataclass(frozen=True)
class Invalid:
    """Call ``call`` turned out malformed (not JSON, an unknown function, cut short): ``text``,
    the model's own text of it, is content after all. A response that is not streamed drops the
    call and keeps ``text``; a streamed one that already sent the call's name cannot take it
    back (its arguments stay as sent, not valid JSON, like a call cut by max_tokens)."""

    call: int
    text: str


ToolEvent = Content | Name | Arguments | Invalid


def tool_names(tools: list[dict]) -> frozenset[str]:
    """The function names of an OpenAI ``tools`` list."""
    return frozenset(t["function"]["name"] for t in tools if t.get("type") == "function")


class ToolParser(ABC):
    """Finds the tool calls a model wrote in its output (for ``tool_choice`` ``auto``).

    ``feed(text)`` and ``finish()`` return what the text held, in order: ``Content``, and for
    each call its ``Name`` then ``Arguments`` fragments (or ``Invalid``). Every call begun must
    end: well-formed (its arguments a JSON object) or ``Invalid`` by ``finish``."""

    # the server decodes with special tokens kept when the format's markers are special tokens
    # (Mistral's [TOOL_CALLS], Llama's <|python_tag|>), as vLLM does
    keep_special_tokens = False

    def __init__(self, tools: list[dict]):
        self.tools = tools
        self.names = tool_names(tools)

    @abstractmethod
    def feed(self, text: str) -> list[ToolEvent]:
        """The next piece of the output: what it completes (a marker's start may be held)."""

    def finish(self) -> list[ToolEvent]:
        """The output ended: what was held back, and ``Invalid`` for a call left open."""
        return []

    def call_id(self) -> str:
        """The id of a call (a format may want its own: Mistral's templates take 9 letters)."""
        return f"call_{uuid.uuid4().hex[:24]}"


class ReasoningParser(ABC):
    """Splits a model's output into its reasoning (``reasoning_content``) and its answer.

    ``thinking`` False: the request turned thinking off (``chat_template_kwargs.enable_thinking``
    false) or constrained the output with a grammar, so reasoning is only where the output
    itself opens a reasoning section. ``feed`` and ``finish`` return ``(reasoning, content)``,
    the new text of each (reasoning comes first in the output)."""

    keep_special_tokens = False

    def __init__(self, thinking: bool = True):
        self.thinking = thinking

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """The next piece of the output: its (reasoning, content) text (a marker may be held)."""

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back."""
        return "", ""


def hold_back(text: str, markers) -> int:
    """How many characters at the end of ``text`` may be the start of one of ``markers``
    (to be held until the next piece of output says whether they are)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best
