"""One chat choice's output text made into its message: the reasoning (``reasoning_content``,
with ``--reasoning-parser``), the content and the tool calls (``tool_calls``), and for a
streamed response the OpenAI deltas of each piece of text, in order. The reasoning parser reads
the output first; its answer goes on to the tool parser. The same instance reads a streamed and
a whole output, so both read the same.

A parser (a plugin's) that raises is logged and left out for the rest of the output, whose text
is then content as it comes: a bug in a parser never fails the request."""

from __future__ import annotations

import logging

from engine.parsers import ToolCalls

logger = logging.getLogger("engine.server")


class ChoiceOutput:
    def __init__(self, reasoning=None, tools=None, stream_reasoning: bool = True):
        """``reasoning``: a ReasoningParser, ``tools``: a ToolParser (None: not read);
        ``stream_reasoning`` False (SGLang's): the reasoning goes out as one delta, when the
        answer starts or the output ends."""
        self.reasoning = reasoning
        self.stream_reasoning = stream_reasoning
        self.held: list[str] = []  # reasoning not sent yet (stream_reasoning False)
        self.calls = ToolCalls(tools) if tools is not None else None
        self.separate = reasoning is not None  # the message has reasoning_content
        self.reasoning_text: list[str] = []
        self.content: list[str] = []  # without a tool parser

    def feed(self, text: str) -> list[dict]:
        """The deltas of the output's next piece: ``{"reasoning_content": ...}``,
        ``{"content": ...}``, ``{"tool_calls": [...]}``."""
        if not text:
            return []
        reasoning, content = self._reason("feed", text)
        return self._route(reasoning, content, "feed")

    def finish(self) -> list[dict]:
        reasoning, content = self._reason("finish")
        deltas = self._route(reasoning, content, "feed")
        if self.held:  # the output ended inside its reasoning
            deltas.insert(0, {"reasoning_content": "".join(self.held)})
            self.held = []
        if self.calls is not None:
            deltas += self._tool("finish")
        return deltas

    @property
    def called(self) -> bool:
        """After ``finish``: whether the output made a well-formed call."""
        return self.calls is not None and bool(self.calls.calls)

    def message(self) -> dict:
        """After ``finish``: the choice's message."""
        if self.calls is not None:
            content, calls = self.calls.result()
        else:
            content, calls = "".join(self.content), []
        message = {"role": "assistant", "content": content}
        if self.separate:
            message["reasoning_content"] = "".join(self.reasoning_text) or None
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        return message

    def _reason(self, method: str, *args) -> tuple[str, str]:
        if self.reasoning is None:
            return "", args[0] if args else ""
        try:
            return getattr(self.reasoning, method)(*args)
        except Exception:
            logger.exception("reasoning parser %s failed; the rest of this output is content",
                             type(self.reasoning).__name__)
            self.reasoning = None
            return "", args[0] if args else ""

    def _route(self, reasoning: str, content: str, method: str) -> list[dict]:
        deltas: list[dict] = []
        if reasoning:
            self.reasoning_text.append(reasoning)
            if self.stream_reasoning:
                deltas.append({"reasoning_content": reasoning})
            else:
                self.held.append(reasoning)
        if content:
            if self.held:  # the answer starts: the reasoning, whole, first
                deltas.append({"reasoning_content": "".join(self.held)})
                self.held = []
            if self.calls is not None:
                deltas += self._tool(method, content)
            else:
                self.content.append(content)
                deltas.append({"content": content})
        return deltas

    def _tool(self, method: str, *args) -> list[dict]:
        try:
            return getattr(self.calls, method)(*args)
        except Exception:
            logger.exception("tool parser %s failed; the rest of this output is content",
                             type(self.calls.parser).__name__)
            content, _ = self.calls.result()
            self.content = [content or ""]
            self.calls = None
            text = args[0] if args else ""
            self.content.append(text)
            return [{"content": text}] if text else []
