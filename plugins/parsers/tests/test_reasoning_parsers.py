"""The reasoning parsers on hand-written outputs, read whole and streamed in every split: the
reasoning and the answer apart, the markers in neither."""

from __future__ import annotations

import pytest
from engine_parsers.think import DeepSeekR1Parser, Qwen3Parser, Qwen3ThinkingParser


def read(parser, pieces):
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


def every_split(cls, text, thinking=True, sections=True):
    """``sections``: the output's markers open and close sections (none is left in the text)."""
    expected = read(cls(thinking), [text])
    for i in range(len(text) + 1):
        assert read(cls(thinking), [text[:i], text[i:]]) == expected, i
    assert read(cls(thinking), list(text)) == expected
    for part in expected if sections else ():
        assert "<think" not in part and "</think" not in part
    return expected


@pytest.mark.parametrize("cls", [DeepSeekR1Parser, Qwen3Parser])
def test_opened_and_closed_in_the_output(cls):
    text = "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4."
    assert every_split(cls, text) == ("The user wants 2+2.", "It is 4.")


def test_qwen3_thinking_starts_in_reasoning_as_deepseek_r1_does():
    assert every_split(Qwen3ThinkingParser, "Hmm.</think>4") == ("Hmm.", "4")


def test_deepseek_r1_starts_in_reasoning_the_template_opened():
    assert every_split(DeepSeekR1Parser, "Hmm, 2+2 < 5.\n</think>\n\n4") == ("Hmm, 2+2 < 5.", "4")


def test_deepseek_r1_cut_while_thinking_is_all_reasoning():
    assert every_split(DeepSeekR1Parser, "Let me think about <thi") == (
        "Let me think about <thi", "")


def test_qwen3_without_think_is_all_content():
    text = "Just 4 </think> here."
    assert every_split(Qwen3Parser, text, sections=False) == ("", text)


@pytest.mark.parametrize("cls", [DeepSeekR1Parser, Qwen3Parser])
def test_thinking_off_leaves_an_unopened_output_alone(cls):
    assert every_split(cls, "4, plainly.\n</think>", thinking=False,
                       sections=False) == (
        "", "4, plainly.\n</think>")
    assert every_split(cls, "<think>x</think>y", thinking=False) == ("x", "y")


def test_empty_section_and_empty_output():
    assert every_split(Qwen3Parser, "<think>\n\n</think>\n\nHello") == ("", "Hello")
    assert read(DeepSeekR1Parser(), []) == ("", "")
