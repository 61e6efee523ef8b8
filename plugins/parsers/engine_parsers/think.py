"""Reasoning between ``<think>`` and ``</think>``: ``deepseek-r1`` (DeepSeek-R1 and its
distills: the chat template opens the section in the prompt, so the output starts in it and
usually shows only ``</think>``) and ``qwen3`` (Qwen3: reasoning only when the output opens
``<think>`` itself; ``qwen3-thinking``: its thinking-only releases, whose template opens it
in the prompt). A section that never closes is all reasoning (the output was cut while
thinking). With thinking off (``chat_template_kwargs.enable_thinking`` false, or a grammar
forcing the output) only a section the output opens itself is reasoning. The whitespace around
the markers is dropped."""

from __future__ import annotations

from engine.parsers import ReasoningParser, hold_back

from engine_parsers.text import starts

START, END = "<think>", "</think>"


class ThinkParser(ReasoningParser):
    opens_in_prompt = False  # the template opens the section: the output starts in it

    def __init__(self, thinking: bool = True):
        super().__init__(thinking)
        self.buf, self.state = "", "start"  # start | reasoning | after | content
        self.started, self.held = False, ""  # reasoning: any sent yet; trailing whitespace

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        while self.buf:
            if self.state == "start":
                opened = starts(self.buf, START, final)
                if opened is None:
                    break
                if opened:
                    self.buf = self.buf.lstrip()[len(START):]
                    self.state = "reasoning"
                else:
                    self.state = "reasoning" if self.opens_in_prompt and self.thinking \
                        else "content"
            elif self.state == "reasoning":
                i = self.buf.find(END)
                if i >= 0:
                    reasoning += self._reasoning(self.buf[:i])
                    self.buf, self.state, self.held = self.buf[i + len(END):], "after", ""
                    continue
                keep = 0 if final else hold_back(self.buf, (END,))
                reasoning += self._reasoning(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            elif self.state == "after":
                s = self.buf.lstrip()
                self.buf = s
                if s:
                    self.state = "content"
            else:
                content += self.buf
                self.buf = ""
        return reasoning, content

    def _reasoning(self, text: str) -> str:
        """Reasoning text without the whitespace that opens and ends the section."""
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body


class DeepSeekR1Parser(ThinkParser):
    opens_in_prompt = True


class Qwen3Parser(ThinkParser):
    opens_in_prompt = False


class Qwen3ThinkingParser(ThinkParser):
    """Qwen3's thinking-only releases (2507), whose template opens the section."""

    opens_in_prompt = True
