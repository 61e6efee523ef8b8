"""``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling; SGLang's ``llama3``): the output is
the calls themselves, JSON objects ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``) separated by ``;``, optionally after ``<|python_tag|>``. An output that does
not begin with such an object (its first key "name") is an answer, all content; what follows
the calls is content too."""

from __future__ import annotations

from engine.parsers import CallError, CallReader, Content, Invalid, ToolParser

from engine_parsers.text import starts

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        # state: start (the output's first characters) | call | between (after a call) | next
        # (after ';') | text (the rest is content)
        self.buf, self.state, self.count = "", "start", 0
        self.reader: CallReader | None = None
        self.raw = ""  # the open call's own text (and any markup before the first one)

    def feed(self, text: str) -> list:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list:
        out = self._run(final=True)
        if self.state == "call":  # cut short
            out.append(Invalid(self.reader.call, self.raw))
        elif self.raw and self.state in ("start", "next"):
            out.append(Content(self.raw))
        self.state, self.raw = "text", ""
        return out

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
            elif state == "call":
                try:
                    n = self.reader.feed(self.buf, out)
                except CallError as e:  # not a call after all: content, and so is the rest
                    out.append(Invalid(self.reader.call, self.raw + self.buf[:e.consumed]))
                    self.buf, self.raw, self.state = self.buf[e.consumed:], "", "text"
                    continue
                self.raw += self.buf[:n]
                self.buf = self.buf[n:]
                if not self.reader.done:
                    break
                self.raw, self.state = "", "between"
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
