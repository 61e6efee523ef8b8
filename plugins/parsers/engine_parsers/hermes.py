"""``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3; SGLang's ``qwen25``): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text
around them is content. A call that is not such an object, or names a function the request does
not offer, is content (``Invalid``); so is one cut short by the end of the output."""

from __future__ import annotations

from engine.parsers import CallReader, Content

from engine_parsers.buffered import BufferedToolParser
from engine_parsers.text import until_marker

START, END = "<tool_call>", "</tool_call>"


class HermesParser(BufferedToolParser):
    def __init__(self, tools: list[dict]):
        super().__init__(tools, "text")  # state: text | call | close

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
                if not self._call_step(out, "close"):
                    break
            elif not self._closing(END, final):  # after a call's JSON: its closing tag
                break
        return out
