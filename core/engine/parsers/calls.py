"""Tool calls written as JSON, read as they are written (on engine.parsers.json_scan): a call
object ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``), a JSON array of them, or a
call's arguments alone. Each reader reports the call's ``Name`` as soon as it is complete and a
known tool, then its arguments' text as it grows (``Arguments``), the model's own characters.

``feed(text, out)`` appends the events to ``out`` and returns how many characters of ``text``
it consumed (it stops at the end of its value); ``done`` says the value is complete. A text that
cannot be a well-formed call raises ``CallError`` (``NotACall`` when it is not a call at all: a
JSON object whose first key is not "name" where that is required, or a function the request
does not offer), whose ``consumed`` counts the characters of that ``feed`` read before it.
"""

from __future__ import annotations

import json

from engine.parsers.base import Arguments, Content, Invalid, Name
from engine.parsers.json_scan import JsonScanner, JsonSyntaxError

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\n\r"


class CallError(ValueError):
    def __init__(self, message: str, consumed: int):
        super().__init__(message)
        self.consumed = consumed

    def moved(self, by: int) -> CallError:
        """The same error, counted from ``by`` characters earlier."""
        return type(self)(str(self), self.consumed + by)


class NotACall(CallError):
    pass


def _scan(scanner: JsonScanner, text: str) -> int:
    try:
        return scanner.feed(text)
    except JsonSyntaxError as e:
        raise CallError(f"not JSON: {e}", e.consumed) from None


class ArgumentsReader:
    """Call ``call``'s arguments: one JSON object (its name was reported by the caller)."""

    def __init__(self, call: int):
        self.call, self.scanner, self.sent = call, JsonScanner(), 0

    @property
    def done(self) -> bool:
        return self.scanner.done

    def feed(self, text: str, out: list) -> int:
        n = _scan(self.scanner, text)
        body = self.scanner.text.lstrip(_WHITESPACE)
        if body and body[0] != "{":
            raise CallError("the arguments are not a JSON object", n)
        if len(body) > self.sent:
            out.append(Arguments(self.call, body[self.sent:]))
            self.sent = len(body)
        return n


class CallReader:
    """One call object; ``names``: the functions it may call (None: any). ``name_first``: the
    object is a call only if its first key is "name" (a bare JSON object that may be an answer:
    Llama 3's format)."""

    def __init__(self, call: int, names=None, keys=ARGUMENT_KEYS, name_first: bool = False):
        self.call, self.names, self.keys, self.name_first = call, names, keys, name_first
        self.scanner, self.name, self.sent = JsonScanner(), None, 0

    @property
    def done(self) -> bool:
        return self.scanner.done

    def feed(self, text: str, out: list) -> int:
        n = _scan(self.scanner, text)
        try:
            self._report(out)
        except CallError as e:
            raise e.moved(n) from None
        return n

    def _report(self, out: list) -> None:
        sc = self.scanner
        body = sc.text.lstrip(_WHITESPACE)
        if body and body[0] != "{":
            raise NotACall("not a JSON object", 0)
        members = sc.members
        if self.name_first and members and members[0].key != "name":
            raise NotACall(f"a JSON object whose first key is {members[0].key!r}, not 'name'", 0)
        if self.name is None:
            member = next((m for m in members if m.key == "name" and m.end is not None), None)
            if member is not None:
                name = sc.value(member)
                if not isinstance(name, str):
                    raise CallError(f"the name {name!r} is not a string", 0)
                if self.names is not None and name not in self.names:
                    raise NotACall(f"{name!r} is not one of the request's tools", 0)
                self.name = name
                out.append(Name(self.call, name))
        args = next((m for m in members if m.key in self.keys and m.start is not None), None)
        if self.name is not None and args is not None:
            self._arguments(args, out)
        if sc.done:
            if self.name is None:
                raise CallError("a call without a name", 0)
            if args is None:
                out.append(Arguments(self.call, "{}"))

    def _arguments(self, member, out: list) -> None:
        sc = self.scanner
        first = sc.text[member.start]
        if first == "{":  # the object's own text, as it grows
            end = member.end if member.end is not None else len(sc.text)
            if end - member.start > self.sent:
                out.append(Arguments(self.call, sc.text[member.start + self.sent:end]))
                self.sent = end - member.start
        elif first == '"':  # arguments written as a string of JSON: sent once it is complete
            if member.end is None or self.sent:
                return
            text = sc.value(member)
            try:
                ok = isinstance(json.loads(text), dict)
            except ValueError:
                ok = False
            if not ok:
                raise CallError("the arguments are a string that is not a JSON object", 0)
            out.append(Arguments(self.call, text))
            self.sent = len(text)
        else:
            raise CallError("the arguments are not a JSON object", 0)


class CallListReader:
    """A JSON array of call objects (Mistral's ``[TOOL_CALLS] [...]``, the grammar-enforced
    ``tool_choice``); its calls are numbered from ``first``. ``pending``: the text read since
    the last call ended (what a malformed call makes content)."""

    def __init__(self, first: int = 0, names=None, keys=ARGUMENT_KEYS):
        self.first, self.names, self.keys = first, names, keys
        self.count = 0  # calls begun
        self.completed = 0  # calls that ended well-formed
        self.done, self.pending = False, ""
        self._reader: CallReader | None = None
        self._state = "open"  # open -> item (-> after -> item ...) -> done

    def feed(self, text: str, out: list) -> int:
        i = mark = 0  # text[mark:i] is pending: read since the last call ended
        try:
            while i < len(text) and not self.done:
                if self._reader is None:
                    i = self._step(text, i)
                    continue
                i += self._reader.feed(text[i:], out)
                if self._reader.done:
                    self._reader, self._state = None, "after"
                    self.completed += 1
                    self.pending, mark = "", i
        except CallError as e:
            self.pending += text[mark:i + e.consumed]
            raise e.moved(i) from None
        self.pending += text[mark:i]
        return i

    def abandon(self, prefix: str = "") -> list:
        """The list ends unfinished (malformed, or cut short): what its unfinished part is, its
        text since the last complete call (after ``prefix``, markup before the list): the open
        call ``Invalid``, or ``Content`` when no call is open."""
        text, self.pending, self.done = prefix + self.pending, "", True
        if not text:
            return []
        if self._reader is not None:
            return [Invalid(self._reader.call, text)]
        return [Content(text)]

    def _step(self, text: str, i: int) -> int:
        c = text[i]
        if c in _WHITESPACE:
            return i + 1
        state = self._state
        if state == "open":
            if c != "[":
                raise NotACall("not a JSON array", 0)
            self._state = "first"
            return i + 1
        if state in ("first", "item") and c == "{":
            self._reader = CallReader(self.first + self.count, self.names, self.keys)
            self.count += 1
            return i
        if state in ("first", "after") and c == "]":
            self.done = True
            return i + 1
        if state == "after" and c == ",":
            self._state = "item"
            return i + 1
        raise CallError(f"{c!r} in a list of calls", 0)
