"""``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling; SGLang's ``llama3``): the output is
the calls themselves, JSON objects ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``) separated by ``;``, optionally after ``<|python_tag|>``. An output that does
not begin with such an object (its first key "name") is an answer, all content; what follows
the calls is content too."""

from __future__ import annotations

from engine.parsers import CallReader, Content

from engine_parsers.buffered import BufferedToolParser
from engine_parsers.text import starts

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(BufferedToolParser):
    def __init__(self, tools: list[dict]):
        # state: start (the output's first characters) | call | between (after a call) | next
        # (after ';') | text (the rest is content); raw: the open call's own text (and any
        # markup before the first one)
        super().__init__(tools, "start")

    def _ended(self, out: list) -> None:
        if self.raw and self.state in ("start", "next"):  # markup, then no call
            out.append(Content(self.raw))
        super()._ended(out)

    def _run(self, final: bool) -> list:
        out: list = []
        while self.buf:
            state = self.state
            if state == "text":
                out.append(Content(self.buf))
                self.buf = ""
            elif state in ("start", "next"):
                if state == "start":
                    tagged = starts(self.buf, PYTHON_TAG, final)
                    if tagged is None:
                        break
                    if tagged:
                        cut = self.buf.index(PYTHON_TAG) + len(PYTHON_TAG)
                        self.raw, self.buf, self.state = self.buf[:cut], self.buf[cut:], "next"
                        continue
                brace = starts(self.buf, "{", final)
                if brace is None:
                    break
                if not brace:  # not a call: an answer (or, after ';', the rest of one)
                    self.buf, self.raw, self.state = self.raw + self.buf, "", "text"
                    continue
                cut = self.buf.index("{")
                self.raw += self.buf[:cut]
                self.buf = self.buf[cut:]
                self.reader = CallReader(self.count, self.names, name_first=True)
                self.count += 1
                self.state = "call"
            elif state == "call":  # (not a call after all: content, and so is the rest)
                if not self._call_step(out, "between"):
                    break
            else:  # between calls: ';' and the next one, or the rest is content
                more = starts(self.buf, ";", final)
                if more is None:
                    break
                if more:
                    cut = self.buf.index(";") + 1
                    self.raw, self.buf, self.state = self.buf[:cut], self.buf[cut:], "next"
                else:
                    self.state = "text"
        return out
