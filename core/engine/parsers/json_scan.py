"""One JSON value read as it is written: a strict, incremental scanner for the tool-call
parsers (a model's output arrives a few characters at a time, and a call's arguments are
streamed while the model still writes them).

``JsonScanner.feed(text)`` consumes ``text`` up to the end of the value and returns how many
characters it took; ``done`` says the value is complete. The first character that no JSON value
can continue with raises ``JsonSyntaxError`` (whose ``consumed`` says how many characters of
that ``feed`` were good), so a prefix it accepted is always the prefix of some valid JSON. For
the top-level object or array it records every member: its key (None in an array) and where its
value starts and ends in ``text`` (the end is None while the value is still being written).
"""

from __future__ import annotations

import json
import re

_VALUE, _KEY, _COLON, _AFTER, _STRING, _ESCAPE, _UNICODE, _NUMBER, _LITERAL = range(9)
_WHITESPACE = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_NUMBER_RUN = re.compile(r"[0-9eE.+-]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_HEX = frozenset("0123456789abcdefABCDEF")


class JsonSyntaxError(ValueError):
    """Not JSON; ``consumed``: the characters of the last ``feed`` read before the bad one."""

    def __init__(self, message: str, consumed: int):
        super().__init__(message)
        self.consumed = consumed


class Member:
    """A value of the top-level object (``key``) or array (``key`` None): ``start`` and ``end``
    index the scanner's ``text`` (``end`` None while it is being written)."""

    __slots__ = ("end", "key", "start")

    def __init__(self, key: str | None, start: int | None = None):
        self.key, self.start, self.end = key, start, None


class JsonScanner:
    def __init__(self):
        self.text = ""  # what it consumed
        self.done = False
        self.members: list[Member] = []
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._mode = _VALUE
        self._first = False  # just after "{" or "[": the container may close at once
        self._in_key = False
        self._start = 0  # where the key, string or number being read started
        self._rest = ""  # the letters a literal still needs
        self._hex = 0  # the hex digits a \u escape still needs

    def feed(self, text: str) -> int:
        """Consume ``text`` up to the end of the value; how many characters it took."""
        base = len(self.text)
        buf = self.text + text
        i, n = base, len(buf)
        try:
            while i < n and not self.done:
                i = self._step(buf, i, n)
        except JsonSyntaxError as e:
            self.text = buf[:i]
            raise JsonSyntaxError(str(e), i - base) from None
        self.text = buf[:i]
        return i - base

    def finish(self) -> bool:
        """At the end of the output: whether the value is complete (a top-level number ends
        only there)."""
        if not self.done and self._mode == _NUMBER and not self._stack and \
                _NUMBER.fullmatch(self.text, self._start):
            self._value_end(len(self.text))
        return self.done

    def value(self, member: Member):
        """A finished member's value, decoded."""
        return json.loads(self.text[member.start:member.end])

    # -- one step: returns where the next one starts ---------------------------------------------
    def _step(self, buf: str, i: int, n: int) -> int:
        mode = self._mode
        if mode == _STRING:
            j = _STRING_RUN.match(buf, i).end()
            if j == n:
                return n
            c = buf[j]
            if c == '"':
                self._string_end(buf, j + 1)
            elif c == "\\":
                self._mode = _ESCAPE
            else:
                raise JsonSyntaxError(f"a control character ({ord(c):#x}) in a string", 0)
            return j + 1
        c = buf[i]
        if mode == _ESCAPE:
            if c == "u":
                self._mode, self._hex = _UNICODE, 4
            elif c in '"\\/bfnrt':
                self._mode = _STRING
            else:
                raise JsonSyntaxError(f"the escape \\{c} in a string", 0)
            return i + 1
        if mode == _UNICODE:
            if c not in _HEX:
                raise JsonSyntaxError(f"{c!r} in a \\u escape", 0)
            self._hex -= 1
            if not self._hex:
                self._mode = _STRING
            return i + 1
        if mode == _NUMBER:
            j = _NUMBER_RUN.match(buf, i).end()
            if j == n:
                return n
            if not _NUMBER.fullmatch(buf, self._start, j):
                raise JsonSyntaxError(f"the number {buf[self._start:j]!r}", 0)
            self._value_end(j)
            return j  # the character after it is read in the next mode
        if mode == _LITERAL:
            if c != self._rest[0]:
                raise JsonSyntaxError(f"{c!r} in a literal (true, false, null)", 0)
            self._rest = self._rest[1:]
            if not self._rest:
                self._value_end(i + 1)
            return i + 1
        if c in _WHITESPACE:
            return i + 1
        if mode == _VALUE:
            return self._value_start(c, i)
        if mode == _KEY:
            if c == '"':
                self._mode, self._in_key, self._start = _STRING, True, i
            elif c == "}" and self._first:
                self._close(i)
            else:
                raise JsonSyntaxError(f"{c!r} where an object's key should be", 0)
            return i + 1
        if mode == _COLON:
            if c != ":":
                raise JsonSyntaxError(f"{c!r} after a key, where ':' should be", 0)
            self._mode, self._first = _VALUE, False
            return i + 1
        top = self._stack[-1]  # _AFTER: a value ended inside a container
        if c == ",":
            self._mode, self._first = (_KEY if top == "{" else _VALUE), False
        elif c == ("}" if top == "{" else "]"):
            self._close(i)
        else:
            raise JsonSyntaxError(f"{c!r} after a value, where ',' or {'}' if top == '{' else ']'}"
                                  f" should be", 0)
        return i + 1

    def _value_start(self, c: str, i: int) -> int:
        if c == "]" and self._first and self._stack[-1:] == ["["]:
            self._close(i)
            return i + 1
        if len(self._stack) == 1:
            if self._stack[0] == "[":
                self.members.append(Member(None, i))
            else:
                self.members[-1].start = i
        if c in "{[":
            self._stack.append(c)
            self._mode, self._first = (_KEY if c == "{" else _VALUE), True
            return i + 1
        if c == '"':
            self._mode, self._in_key = _STRING, False
            return i + 1
        if c == "-" or "0" <= c <= "9":
            self._mode, self._start = _NUMBER, i
            return i
        if c in _LITERALS:
            self._mode, self._rest = _LITERAL, _LITERALS[c]
            return i
        raise JsonSyntaxError(f"{c!r} where a value should be", 0)

    def _string_end(self, buf: str, end: int) -> None:
        if not self._in_key:
            self._value_end(end)
            return
        self._mode = _COLON
        if len(self._stack) == 1:
            self.members.append(Member(json.loads(buf[self._start:end])))

    def _close(self, i: int) -> None:
        self._stack.pop()
        self._value_end(i + 1)

    def _value_end(self, end: int) -> None:
        if not self._stack:
            self.done = True
            return
        if len(self._stack) == 1:
            self.members[-1].end = end
        self._mode = _AFTER
