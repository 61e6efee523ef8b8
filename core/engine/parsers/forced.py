"""The calls of a grammar-enforced ``tool_choice`` (engine.server.tool_choice builds the
grammar): ``required`` makes the output a JSON array of ``{"name": ..., "parameters": {...}}``
(``RequiredCalls``), a named function makes it that function's arguments alone
(``NamedCall``). The grammar guarantees the form; only a cut (max_tokens) leaves a call open,
which ``finish`` reports ``Invalid``, as a tool parser does."""

from __future__ import annotations

from engine.parsers.base import Content, Invalid, Name, ToolParser
from engine.parsers.calls import ArgumentsReader, CallError, CallListReader


class RequiredCalls(ToolParser):
    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self.reader = CallListReader(0, self.names)

    def feed(self, text: str) -> list:
        out: list = []
        if self.reader.done:
            return [Content(text)] if text else []
        try:
            n = self.reader.feed(text, out)
        except CallError as e:
            out += self.reader.abandon()
            n = e.consumed
        if n < len(text):
            out.append(Content(text[n:]))
        return out

    def finish(self) -> list:
        return [] if self.reader.done else self.reader.abandon()


class NamedCall(ToolParser):
    def __init__(self, tools: list[dict], name: str):
        super().__init__(tools)
        self.name, self.reader, self.text, self.failed = name, ArgumentsReader(0), "", False

    def feed(self, text: str) -> list:
        out: list = []
        if not self.text and not self.failed:
            out.append(Name(0, self.name))
        if self.reader.done or self.failed:
            return out + ([Content(text)] if text else [])
        try:
            n = self.reader.feed(text, out)
        except CallError as e:
            self.failed = True
            self.text += text[:e.consumed]
            out.append(Invalid(0, self.text))
            n = e.consumed
        else:
            self.text += text[:n]
        if n < len(text):
            out.append(Content(text[n:]))
        return out

    def finish(self) -> list:
        if self.failed or self.reader.done:
            return []
        return [Invalid(0, self.text)] if self.text else []  # nothing at all: no call
