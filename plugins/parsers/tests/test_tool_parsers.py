"""Each tool parser on hand-written model outputs: calls and content read whole and streamed
in every split (the same either way, the markup never in the content), several calls, text
around them, and malformed calls returned as content."""

from __future__ import annotations

import functools

import pytest
from engine.parsers import Invalid, Name, ToolCalls
from engine_parsers.hermes import HermesParser
from engine_parsers.llama3_json import Llama3JsonParser
from engine_parsers.mistral import MistralParser
from engine_parsers.pythonic import PythonicParser
from parser_splits import cut_short, every_split, streamed

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]
hermes = functools.partial(HermesParser, TOOLS)
llama3 = functools.partial(Llama3JsonParser, TOOLS)
mistral = functools.partial(MistralParser, TOOLS)
pythonic = functools.partial(PythonicParser, TOOLS)
PARIS = ("get_weather", {"city": "Paris", "days": [1, 2], "note": "a \"quoted\" {brace}"})
UTC = ("get_time", {"tz": "UTC"})
ARGS = '{"city": "Paris", "days": [1, 2], "note": "a \\"quoted\\" {brace}"}'


# -- hermes ---------------------------------------------------------------------------------------
def test_hermes_calls_after_text():
    text = ("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " + ARGS +
            "}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": "
            "{\"tz\": \"UTC\"}}\n</tool_call>")
    assert every_split(hermes, text, ["<tool_call", "</tool", "name"]) == (
        "Let me check.", [PARIS, UTC])


def test_hermes_plain_answer_and_a_lone_less_than():
    assert every_split(hermes, "It is 5 < 7 <tool, sunny.") == ("It is 5 < 7 <tool, sunny.", [])


def test_hermes_missing_closing_tag_is_forgiven():
    text = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}'
    assert every_split(hermes, text) == (None, [UTC])


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not offered
    '<tool_call>not json at all</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
])
def test_hermes_malformed_call_is_content(text):
    content, calls = every_split(hermes, "Hi " + text)
    assert calls == [] and content == "Hi " + text


def test_calls_cut_short_are_content_or_sent_as_they_were_written():
    cut_short(hermes, 'Hi <tool_call>{"name": "get_time", "arguments": {"tz": "UT', "Hi",
              "get_time", '{"tz": "UT')
    cut_short(llama3, '{"name": "get_time", "parameters": {"tz"', "", "get_time", '{"tz"')
    cut_short(mistral, '[TOOL_CALLS] [{"name": "get_time", "arguments": {', "", "get_time", "{")
    # pythonic arguments are sent whole, with the name, once the call's ")" is written
    assert every_split(pythonic, "[get_time(tz='UT") == ("[get_time(tz='UT", [])


def test_hermes_malformed_call_beside_a_good_one():
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    good = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    content, calls = every_split(hermes, bad + "\n" + good)
    assert calls == [UTC] and content == bad


def test_streamed_call_sends_name_before_arguments_in_fragments():
    text = '<tool_call>{"name": "get_weather", "arguments": ' + ARGS + "}</tool_call>"
    _, _, deltas = streamed(hermes, [text[i:i + 3] for i in range(0, len(text), 3)])
    parts = [tc for d in deltas for tc in d["tool_calls"]]
    assert parts[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert parts[0]["id"].startswith("call_") and len(parts) > 5
    assert "".join(p["function"]["arguments"] for p in parts) == ARGS


def test_a_streamed_call_found_malformed_after_its_name_keeps_it_out_of_the_content():
    parser = ToolCalls(hermes())
    parser.feed('<tool_call>{"name": "get_time", "arguments": ')
    parser.feed('[1]}</tool_call>')
    parser.finish()
    content, calls = parser.result()
    assert calls == [] and "get_time" in content  # not streamed: the text is content


# -- llama3_json ----------------------------------------------------------------------------------
def test_llama3_json_calls_separated_by_semicolons():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": ' + ARGS +
            '}; {"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert every_split(llama3, text, ["python_tag", "parameters"]) == (None, [PARIS, UTC])


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '{"answer": 42}',  # a JSON answer, not a call: its first key is not "name"
    '{"name": "Bob", "age": 4}',  # a name that is no function
])
def test_llama3_json_answers_and_malformed_calls_are_content(text):
    assert every_split(llama3, text) == (text, [])


def test_llama3_json_text_after_the_calls_is_content():
    text = '{"name": "get_time", "arguments": {"tz": "UTC"}} and then some'
    assert every_split(llama3, text) == (" and then some", [UTC])


# -- mistral --------------------------------------------------------------------------------------
def test_mistral_json_array():
    text = ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + ARGS +
            '}, {"name": "get_time", "arguments": {"tz": "UTC"}}]')
    assert every_split(mistral, text, ["TOOL_CALLS", "name"]) == ("Sure.", [PARIS, UTC])


def test_mistral_name_and_args_form():
    text = ('[TOOL_CALLS]get_weather[ARGS]' + ARGS +
            '[TOOL_CALLS]get_time{"tz": "UTC"}')
    assert every_split(mistral, text, ["TOOL_CALLS", "ARGS"]) == (None, [PARIS, UTC])


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]',
    '[TOOL_CALLS] [5]',
    '[TOOL_CALLS]nope[ARGS]{}',
    '[TOOL_CALLS]',
])
def test_mistral_malformed_calls_are_content(text):
    assert every_split(mistral, text) == (text, [])


def test_mistral_second_call_malformed_keeps_the_first():
    text = ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}, '
            '{"name": "nope", "arguments": {}}]')
    content, calls = every_split(mistral, text)
    assert calls == [UTC] and '{"name": "nope"' in content


def test_mistral_ids_are_nine_letters_and_digits():
    call_id = mistral().call_id()
    assert len(call_id) == 9 and call_id.isalnum()
    assert mistral.func.keep_special_tokens


# -- pythonic -------------------------------------------------------------------------------------
def test_pythonic_list_of_calls():
    text = ('[get_weather(city="Paris", days=[1, 2], note=\'a "quoted" {brace}\'), '
            'get_time(tz="UTC")]')
    assert every_split(pythonic, text, ["get_", "("]) == (None, [PARIS, UTC])


def test_pythonic_tags_literals_and_text_after():
    text = "<|python_start|>[get_time(tz=None, dst=True, n=-1.5)]<|python_end|> Done."
    assert every_split(pythonic, text, ["python_"]) == (
        " Done.", [("get_time", {"tz": None, "dst": True, "n": -1.5})])


@pytest.mark.parametrize("text", [
    "[1, 2, 3] are numbers",
    "[citation needed]",
    "[launch(n=1)]",  # not offered
    "[get_time(tz=os.environ)]",  # not a literal
    "[get_time('UTC')]",  # positional
    "Answer: [get_time()]",  # not at the start: text
])
def test_pythonic_answers_and_malformed_calls_are_content(text):
    assert every_split(pythonic, text) == (text, [])


def test_parser_events_name_a_call_once_before_its_arguments():
    events = HermesParser(TOOLS).feed('<tool_call>{"name": "get_time", "arguments": {}}')
    assert isinstance(events[0], Name) and not any(isinstance(e, Invalid) for e in events)
