"""``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3; SGLang's ``qwen25``): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text
around them is content. A call that is not such an object, or names a function the request does
not offer, is content (``Invalid``); so is one cut short by the end of the output."""

from __future__ import annotations

from engine.parsers import CallError, CallReader, Content, Invalid, ToolParser

from engine_parsers.text import starts, until_marker

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self.buf, self.state, self.count = "", "text", 0  # state: text | call | close
        self.reader: CallReader | None = None
        self.raw = ""  # the open call's own text, from its marker

    def feed(self, text: str) -> list:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list:
        out = self._run(final=True)
        if self.state == "call":  # cut short
            out.append(Invalid(self.reader.call, self.raw))
        self.state = "text"
        return out

    def _run(self, final: bool) -> list:
        out: list = []
        while self.buf:
            if self.state == "text":
                text, marker, self.buf = until_marker(self.buf, (START,), final)
                if text:
                    out.append(Content(text))
                if marker is None:
                    break
                self.reader, self.raw, self.state = CallReader(self.count, self.names), START, \
                    "call"
                self.count += 1
            elif self.state == "call":
                try:
                    n = self.reader.feed(self.buf, out)
                except CallError as e:  # the call's text so far is content; the rest is text
                    out.append(Invalid(self.reader.call, self.raw + self.buf[:e.consumed]))
                    self.buf, self.state = self.buf[e.consumed:], "text"
                    continue
                self.raw += self.buf[:n]
                self.buf = self.buf[n:]
                if not self.reader.done:
                    break
                self.state = "close"
            else:  # after a call's JSON: its closing tag (a missing one is forgiven)
                closed = starts(self.buf, END, final)
                if closed is None:
                    break
                if closed:
                    self.buf = self.buf.lstrip()[len(END):]
                self.state = "text"
        return out
