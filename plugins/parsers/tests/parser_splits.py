"""A parser run on a whole output and on the same output streamed in every split of it: what
the tests of each parser compare."""

from __future__ import annotations

import json

from engine.parsers import ToolCalls


def whole(factory, text: str):
    """(content, [(name, arguments as a dict)]) of ``text`` read at once, as a response that is
    not streamed makes it."""
    calls = ToolCalls(factory())
    calls.feed(text)
    calls.finish()
    content, found = calls.result()
    return content, [(c.name, json.loads(c.arguments)) for c in found]


def streamed(factory, pieces: list[str], raw: bool = False):
    """The same from the OpenAI deltas of ``pieces`` streamed: (content, calls, the deltas);
    ``raw``: the calls' arguments as the text sent (a call cut short is no JSON)."""
    calls = ToolCalls(factory())
    deltas = []
    for piece in pieces:
        deltas += calls.feed(piece)
    deltas += calls.finish()
    content = "".join(d.get("content", "") for d in deltas)
    sent: dict[int, list] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            if "id" in tc:  # a call's first delta: id, type, name (and no arguments yet)
                assert tc["index"] == len(sent) and tc["type"] == "function", deltas
                assert tc["id"] and tc["function"]["arguments"] == "", deltas
                sent[tc["index"]] = [tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"}, deltas
                sent[tc["index"]][1] += tc["function"]["arguments"]
    calls = [(n, a if raw else json.loads(a)) for n, a in sent.values()]
    return content or None, calls, deltas


def every_split(factory, text: str, markup=()):
    """``text`` read whole, then streamed cut at every point (and in single characters): every
    stream gives the same content and calls, and no piece of ``markup`` reaches the content.
    Returns (content, calls)."""
    expected = whole(factory, text)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        content, calls, deltas = streamed(factory, pieces)
        assert (content, calls) == expected, (pieces, deltas)
        for marker in markup:
            assert marker not in (content or ""), (pieces, deltas)
    return expected


def cut_short(factory, text: str, before: str, name: str, arguments: str):
    """``text`` ends inside a call to ``name``: read whole, all of it is content; streamed in
    any split, ``before`` is content and the call was sent (it cannot be taken back) with the
    ``arguments`` written, as a call cut by max_tokens is."""
    assert whole(factory, text) == (text, [])
    for i in range(len(text) + 1):
        content, calls, deltas = streamed(factory, [text[:i], text[i:]], raw=True)
        assert (content, calls) == (before or None, [(name, arguments)]), (i, deltas)
