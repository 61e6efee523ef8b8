"""``pythonic`` (Llama 3.2 / Llama 4's Python-list calls, vLLM's and SGLang's ``pythonic``):
the output is a Python list of calls with keyword arguments of literal values,
``[get_weather(city="Paris", days=3), get_time(tz="UTC")]`` (optionally between
``<|python_start|>`` and ``<|python_end|>``); what follows it is content. An output that does
not begin with ``[name(`` for one of the request's functions is an answer, all content. A
call's name is reported when its ``(`` is written, its arguments (as a JSON object) when its
``)`` is; one whose arguments are not literals is content (``Invalid``)."""

from __future__ import annotations

import ast
import json
import re

from engine.parsers import Arguments, Content, Invalid, Name

from engine_parsers.buffered import BufferedToolParser
from engine_parsers.text import starts

START, END = "<|python_start|>", "<|python_end|>"
_CALL = re.compile(r"\s*([A-Za-z_][\w.]*)\s*(\()?")
_OPEN, _CLOSE = "([{", ")]}"


class PythonicParser(BufferedToolParser):
    def __init__(self, tools: list[dict]):
        # state: start | list (before a call) | call (inside one) | after (after a call: ',' or
        # ']') | end (after the list) | text (the rest is content); raw: text not yet part of a
        # well-formed call (content if the list fails)
        super().__init__(tools, "start")
        self.call_text = ""  # the open call's text, from its name
        self._depth, self._quote, self._escape = 0, "", False

    def _ended(self, out: list) -> None:
        if self.state == "call":  # cut short
            out.append(Invalid(self.count - 1, self.raw + self.call_text))
        elif self.state in ("start", "list", "after") and self.raw + self.buf:
            out.append(Content(self.raw + self.buf))
        self.state, self.raw, self.buf = "text", "", ""

    def _run(self, final: bool) -> list:
        out: list = []
        while self.buf:
            state = self.state
            if state == "text":
                out.append(Content(self.buf))
                self.buf = ""
            elif state == "start":
                if not self._start(final):
                    break
            elif state == "list":
                m = _CALL.match(self.buf)
                if m is None:
                    if self.buf.strip():  # not a name: not a call
                        self._give_up(out)
                        continue
                    break
                if not m.group(2) and m.end() == len(self.buf) and not final:
                    break  # a name still being written
                if not m.group(2) or m.group(1) not in self.names:
                    self._give_up(out)
                    continue
                out.append(Name(self.count, m.group(1)))
                self.count += 1
                self.call_text, self.buf = self.buf[:m.end()], self.buf[m.end():]
                self._depth, self._quote, self._escape = 1, "", False
                self.state = "call"
            elif state == "call":
                end = self._scan()
                if end is None:
                    self.call_text += self.buf
                    self.buf = ""
                    break
                self.call_text += self.buf[:end]
                self.buf = self.buf[end:]
                self._call_ended(out)
            elif state == "after":
                s = self.buf.lstrip()
                if not s:
                    break
                self.raw += self.buf[:len(self.buf) - len(s)] + s[0]
                self.buf = s[1:]
                if s[0] == ",":
                    self.state = "list"
                elif s[0] == "]":
                    self.raw, self.state = "", "end"
                else:
                    self._give_up(out)
            elif not self._closing(END, final):  # end: an optional <|python_end|>, then content
                break
        return out

    def _start(self, final: bool) -> bool:
        """The output's first characters: ``[`` (or ``<|python_start|>[``) begins the list."""
        tagged = starts(self.buf, START, final)
        if tagged is None:
            return False
        if tagged:
            cut = self.buf.index(START) + len(START)
            self.raw, self.buf = self.raw + self.buf[:cut], self.buf[cut:]
            if not self.buf:
                return False
        listed = starts(self.buf, "[", final)
        if listed is None:
            return False
        if listed:
            cut = self.buf.index("[") + 1
            self.raw, self.buf, self.state = self.raw + self.buf[:cut], self.buf[cut:], "list"
        else:
            self.buf, self.raw, self.state = self.raw + self.buf, "", "text"
        return True

    def _scan(self) -> int | None:
        """Where the open call's ``)`` ends in ``buf`` (strings and brackets followed)."""
        for i, c in enumerate(self.buf):
            if self._quote:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == self._quote:
                    self._quote = ""
            elif c in "'\"":
                self._quote = c
            elif c in _OPEN:
                self._depth += 1
            elif c in _CLOSE:
                self._depth -= 1
                if not self._depth:
                    return i + 1
        return None

    def _call_ended(self, out: list) -> None:
        call = self.count - 1
        try:
            arguments = _arguments(self.call_text)
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
            out.append(Invalid(call, self.raw + self.call_text))
            self.raw, self.state = "", "text"
            return
        out.append(Arguments(call, arguments))
        self.raw, self.call_text, self.state = "", "", "after"

    def _give_up(self, out: list) -> None:
        """Not a list of calls after all: what was held is content, and so is the rest."""
        self.buf, self.raw, self.state = self.raw + self.buf, "", "text"


def _arguments(text: str) -> str:
    """A call's keyword arguments as a JSON object (ValueError when they are not literals)."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments only")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("**kwargs")
        args[kw.arg] = ast.literal_eval(kw.value)
    return json.dumps(args, ensure_ascii=False, allow_nan=False)
