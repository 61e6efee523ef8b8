"""A tool parser's events made into a chat response: the calls with their ids and the content
(``ToolCalls.result``), and for a streamed one the OpenAI deltas of each piece of output, a
call's id and name first (with ``"arguments": ""``), then its arguments' fragments, as the
OpenAI API sends them. A call's name is sent when its arguments begin (a JSON object), so that a
call whose arguments are not one is still content.

When a response has calls, its content loses its trailing whitespace (a model writes a newline
or two between its text and its calls; all whitespace: no content at all), so a streamed
response holds trailing whitespace back until more text follows it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.parsers.base import Arguments, Content, Invalid, Name, ToolParser


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCalls:
    """One choice's tool calls as its output arrives (``feed``, then ``finish``)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.calls: dict[int, ToolCall] = {}  # the parser's call number -> the call, in order
        self.index: dict[int, int] = {}  # -> its index in the streamed deltas
        self.content: list[str] = []
        self.held = ""  # streamed: trailing whitespace not sent yet

    def feed(self, text: str) -> list[dict]:
        """The deltas of the output's next piece: ``{"content": ...}`` and ``{"tool_calls":
        [...]}``, in order."""
        return self._take(self.parser.feed(text)) if text else []

    def finish(self) -> list[dict]:
        deltas = self._take(self.parser.finish())
        if self.held and not self.index:  # no call: the whitespace is content after all
            deltas.append({"content": self.held})
        self.held = ""
        return deltas

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """After ``finish``: the content (None when calls leave none) and the well-formed
        calls (a malformed one's text is in the content)."""
        content, calls = "".join(self.content), list(self.calls.values())
        if calls:
            content = content.rstrip() or None
        return content, calls

    def _take(self, events) -> list[dict]:
        deltas: list[dict] = []
        for event in events:
            if isinstance(event, Content):
                self._content(event.text, deltas)
            elif isinstance(event, Name):  # sent with its first arguments: by then a call
                # whose arguments are no JSON object has turned out Invalid, and is content
                self.calls[event.call] = ToolCall(self.parser.call_id(), event.name)
            elif isinstance(event, Arguments):
                call = self.calls[event.call]
                call.arguments += event.text
                if event.call not in self.index:
                    self.index[event.call] = index = len(self.index)
                    deltas.append({"tool_calls": [{"index": index, **call.as_openai()}]})
                    deltas[-1]["tool_calls"][0]["function"]["arguments"] = ""
                last = deltas[-1]["tool_calls"][-1] if deltas and "tool_calls" in deltas[-1] \
                    else None
                index = self.index[event.call]
                if last is not None and last["index"] == index and "id" not in last:
                    last["function"]["arguments"] += event.text
                else:
                    deltas.append({"tool_calls": [{"index": index, "function": {
                        "arguments": event.text}}]})
            elif isinstance(event, Invalid):
                self.calls.pop(event.call, None)
                self.content.append(event.text)
                if event.call not in self.index:  # never sent as a call: it is content
                    self._send(event.text, deltas)
        return deltas

    def _content(self, text: str, deltas: list[dict]) -> None:
        self.content.append(text)
        self._send(text, deltas)

    def _send(self, text: str, deltas: list[dict]) -> None:
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        if not body:
            return
        if deltas and "content" in deltas[-1]:
            deltas[-1]["content"] += body
        else:
            deltas.append({"content": body})
