"""A chat template render's budget: its deadline and the characters it may make, in force on the
rendering thread while it renders (the sandbox checks it at every call, lookup, operator, filter
and loop iteration: server/template_sandbox.py), and the error a render over it raises."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


class ChatTemplateError(Exception):
    """A template that cannot be used or rendered: a 400 for the request. ``param``: the request
    field it is about; ``limit``: "time" or "size" when a render went over its budget."""

    def __init__(self, message: str, param: str = "messages", limit: str | None = None):
        super().__init__(message)
        self.param, self.limit = param, limit


class Budget:
    """One render's limits: a deadline and a number of characters."""

    __slots__ = ("deadline", "timeout_s", "max_chars", "ticks")

    def __init__(self, timeout_s: float, max_chars: int):
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self.deadline = time.monotonic() + timeout_s
        self.ticks = 0

    def time_up(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(
                f"the chat template took longer than {self.timeout_s:g} s to render; it was "
                f"stopped", limit="time")

    def too_big(self, n: int, what: str = "a value") -> None:
        if n > self.max_chars:
            raise ChatTemplateError(
                f"the chat template rendered more than {self.max_chars} characters, the limit "
                f"of one render ({what} would have {n}); it was stopped", limit="size")


_current = threading.local()  # the budget of the render running on this thread


@contextmanager
def in_force(budget: Budget):
    """``budget`` is the running render's on this thread until the block ends."""
    _current.budget = budget
    try:
        yield
    finally:
        _current.budget = None


def current() -> Budget | None:
    """The budget of the render running on this thread, if any."""
    return getattr(_current, "budget", None)


def tick() -> None:
    b = current()
    if b is not None:
        b.time_up()


def size_of(value) -> int:
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3  # about its decimal digits
    return 0


def checked(value, what: str = "a value"):
    """``value``, once the running render's budget has room for it (else ChatTemplateError)."""
    b = current()
    if b is not None:
        b.time_up()
        b.too_big(size_of(value), what)
    return value
