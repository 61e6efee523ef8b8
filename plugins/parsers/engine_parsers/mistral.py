"""``mistral``: calls after the ``[TOOL_CALLS]`` token, as a JSON array of ``{"name": ...,
"arguments": {...}}`` (the v3 tokenizers' form), or as ``name[ARGS]{...}`` after each
``[TOOL_CALLS]`` (v11 and later; ``name{...}`` too); text before the token is content.
``[TOOL_CALLS]`` is a special token, so the output is decoded with special tokens kept; call
ids are 9 letters and digits, as Mistral's chat templates require."""

from __future__ import annotations

import random
import re
import string

from engine.parsers import (
    ArgumentsReader,
    CallError,
    CallListReader,
    CallReader,
    Content,
    Invalid,
    Name,
)

from engine_parsers.buffered import BufferedToolParser
from engine_parsers.text import until_marker

START, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z_][\w.-]*")
_ID_CHARS = string.ascii_letters + string.digits


class MistralParser(BufferedToolParser):
    keep_special_tokens = True

    def __init__(self, tools: list[dict]):
        # state: text | kind (just after [TOOL_CALLS]) | list | object | name | args; reader: a
        # CallListReader, CallReader or ArgumentsReader; raw: the markup and the open call's text
        super().__init__(tools, "text")

    def call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def _ended(self, out: list) -> None:
        if self.state != "text":  # cut short
            self._fail(out)

    def _run(self, final: bool) -> list:
        out: list = []
        while self.buf:
            state = self.state
            if state == "text":
                text, marker, self.buf = until_marker(self.buf, (START,), final)
                if text:
                    out.append(Content(text))
                if marker is None:
                    break
                self.raw, self.state = marker, "kind"
            elif state == "kind":
                s = self.buf.lstrip()
                if not s:
                    self.raw, self.buf = self.raw + self.buf, ""
                    break
                self.raw += self.buf[:len(self.buf) - len(s)]
                self.buf = s
                if s[0] == "[":
                    self.reader, self.state = CallListReader(self.count, self.names), "list"
                elif s[0] == "{":
                    self.reader, self.state = CallReader(self.count, self.names), "object"
                    self.count += 1
                elif _NAME.match(s[0]):
                    self.state = "name"
                else:
                    self._fail(out)
            elif state == "name":
                if not self._name(out, final):
                    break
            elif state == "list":  # (a list keeps its own text: CallListReader.pending)
                try:
                    n = self.reader.feed(self.buf, out)
                except CallError as e:
                    self.buf = self.buf[e.consumed:]
                    self._fail(out)
                    continue
                self.buf = self.buf[n:]
                if not self.reader.done:
                    break
                self.count += self.reader.count
                self.raw, self.state = "", "text"
            elif not self._call_step(out, "text"):  # object, args: a call's reader
                break
        return out

    def _name(self, out: list, final: bool) -> bool:
        """``name[ARGS]`` or ``name{``: the call's name; False while it is not complete."""
        text, marker, rest = until_marker(self.buf, (ARGS, "{"), final)
        if marker is None:
            if final or len(self.buf) > 256 or (text and not _NAME.fullmatch(text)):
                self._fail(out)
                return True
            return False
        name = text.strip()
        if not _NAME.fullmatch(name) or name not in self.names:
            self._fail(out)
            return True
        self.raw += text + marker
        self.buf = ("{" + rest) if marker == "{" else rest
        out.append(Name(self.count, name))
        self.reader, self.state = ArgumentsReader(self.count), "args"
        self.count += 1
        return True

    def _fail(self, out: list) -> None:
        """The markup and the open call are content after all; what follows is read as text
        again."""
        if self.state == "list":
            out += self.reader.abandon(self.raw if not self.reader.completed else "")
            self.count += self.reader.count
        elif self.state in ("object", "args"):
            out.append(Invalid(self.reader.call, self.raw))
        elif self.raw:
            out.append(Content(self.raw))
        self.raw, self.state = "", "text"
