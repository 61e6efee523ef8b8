"""What the tool parsers' state machines share: the output not yet read held in a buffer,
``feed`` and ``finish`` running the parser's states over it, and the step of a call read by a
reader of JSON (``CallReader`` and the like)."""

from __future__ import annotations

from abc import abstractmethod

from engine.parsers import CallError, Invalid, ToolParser

from engine_parsers.text import starts


class BufferedToolParser(ToolParser):
    """A tool parser whose states (``_run``) read ``buf``, the output not yet read: ``feed``
    appends to it and runs them, ``finish`` runs them once more with nothing left to wait for,
    then ``_ended`` says what is still held (an open call cut short is ``Invalid``)."""

    def __init__(self, tools: list[dict], state: str):
        super().__init__(tools)
        self.buf, self.state, self.count = "", state, 0
        self.reader = None  # the open call's reader (CallReader and the like)
        self.raw = ""  # the open call's own text, and markup before it (content if it fails)

    def feed(self, text: str) -> list:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list:
        out = self._run(final=True)
        self._ended(out)
        return out

    @abstractmethod
    def _run(self, final: bool) -> list:
        """The events of what ``buf`` holds, read as far as it goes (``final``: the output
        ended, so nothing is held back for the next piece)."""

    def _ended(self, out: list) -> None:
        """The output ended (the states run): a call still open in state "call" was cut short
        and is ``Invalid``; the parser is left in state "text"."""
        if self.state == "call":
            out.append(Invalid(self.reader.call, self.raw))
        self.state, self.raw = "text", ""

    def _call_step(self, out: list, after: str) -> bool:
        """Feeds ``buf`` to the open call's reader (its text goes to ``raw``): False while the
        call needs more text; True when it is done (the state becomes ``after``) or malformed
        (its text so far is ``Invalid`` content, and the state "text" reads the rest)."""
        try:
            n = self.reader.feed(self.buf, out)
        except CallError as e:
            out.append(Invalid(self.reader.call, self.raw + self.buf[:e.consumed]))
            self.buf, self.raw, self.state = self.buf[e.consumed:], "", "text"
            return True
        self.raw += self.buf[:n]
        self.buf = self.buf[n:]
        if not self.reader.done:
            return False
        self.raw, self.state = "", after
        return True

    def _closing(self, marker: str, final: bool) -> bool:
        """After the calls, their optional closing ``marker`` (a missing one is forgiven): read,
        and the state becomes "text"; False while ``buf`` may still be its start."""
        closed = starts(self.buf, marker, final)
        if closed is None:
            return False
        if closed:
            self.buf = self.buf.lstrip()[len(marker):]
        self.state = "text"
        return True
