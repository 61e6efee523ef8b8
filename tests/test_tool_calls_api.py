"""Tools and reasoning on /v1/chat/completions, end to end: the `openai` client against a real
`engine serve --tool-call-parser hermes --reasoning-parser qwen3` on a tiny random model whose
output a grammar forces (tool_choice required or named: the server's own JSON schema of the
tools; auto: a guided_choice of a hermes call), streamed and not; the calls validate against
their tools' schemas. The request-side rules (which choice needs what, the 400s) are checked
without a model."""

from __future__ import annotations

import json
import os
import types

import pytest
from engine.config import ConfigError, EngineConfig

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
HERMES_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
# renders the tools and the earlier calls and results, so that they show in the prompt
TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}"
    "({{ t.function.parameters.properties | join(',') }}){% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "call {{ c.id }} {{ c.function.name }} {{ c.function.arguments.tz }}{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}] {% endif %}{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ASK = [{"role": "user", "content": "What time is it in Paris?"}]
# a random model would write whitespace for ever where the JSON grammar allows it: penalties
# make it move on
SAMPLED = {"temperature": 1.0, "seed": 3, "max_tokens": 300, "frequency_penalty": 2.0,
           "presence_penalty": 2.0}


@pytest.fixture(scope="module")
def tool_model(tiny_model_factory, tmp_path_factory):
    """The tiny llama with a chat template that renders tools, calls and tool results."""
    src = tiny_model_factory("llama")
    dst = tmp_path_factory.mktemp("tool_model")
    for name in os.listdir(src):
        if name != "tokenizer_config.json":
            os.symlink(os.path.join(src, name), dst / name)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.fixture(scope="module")
def client(start_server, tool_model):
    openai = pytest.importorskip("openai")
    server = start_server("--model", tool_model, "--tool-call-parser", "hermes",
                          "--reasoning-parser", "qwen3", "--grammar-backend", "xgrammar",
                          "--served-model-name", "tiny")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def validate(name: str, arguments: str) -> dict:
    jsonschema = pytest.importorskip("jsonschema")
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def stream(client, **body):
    """(content, reasoning, calls as [id, name, arguments], finish_reason) of a streamed
    response, checking the deltas' form as the OpenAI API sends them."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **body):
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or ():
            if tc.index not in calls:  # first: id, type, name; arguments after
                assert tc.index == len(calls) and tc.id and tc.type == "function"
                assert tc.function.name and not tc.function.arguments
                calls[tc.index] = [tc.id, tc.function.name, ""]
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index][2] += tc.function.arguments
        finish = choice.finish_reason or finish
    return content, reasoning, list(calls.values()), finish


def test_required_calls_validate_against_their_schemas(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False, n=2,
                                       **SAMPLED)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            validate(call.function.name, call.function.arguments)
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false: one call
    content, _, calls, finish = stream(client, messages=ASK, tools=TOOLS,
                                       tool_choice="required", **SAMPLED)
    assert finish == "tool_calls" and content == "" and calls
    for _, name, arguments in calls:
        validate(name, arguments)


def test_named_function_is_called_with_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                       tool_choice=named, **SAMPLED)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    validate("get_weather", call.function.arguments)
    content, _, calls, finish = stream(client, messages=ASK, tools=TOOLS, tool_choice=named,
                                       **SAMPLED)
    assert finish == "tool_calls" and content == "" and [c[1] for c in calls] == ["get_weather"]
    validate("get_weather", calls[0][2])


def test_auto_reads_the_hermes_call_the_model_writes(client):
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 80,
                "extra_body": {"guided_choice": ["Let me see. " + HERMES_CALL]}}
    r = client.chat.completions.create(model="tiny", **body)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Let me see."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
        == [("get_time", {"tz": "CET"})]
    content, reasoning, calls, finish = stream(client, **body)
    assert (content, reasoning, finish) == ("Let me see.", "", "tool_calls")
    assert [(c[1], json.loads(c[2])) for c in calls] == [("get_time", {"tz": "CET"})]


def test_tool_results_reach_the_template(client):
    """The tools, an earlier call (its arguments a dict for the template) and its result all
    lengthen the prompt; tool_choice none leaves the output alone."""
    follow_up = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                                tool_choice="none", max_tokens=1)
    after = client.chat.completions.create(model="tiny", messages=follow_up, tools=TOOLS,
                                           tool_choice="none", max_tokens=1)
    assert plain.usage.prompt_tokens < with_tools.usage.prompt_tokens < after.usage.prompt_tokens
    assert after.choices[0].message.tool_calls is None


def test_reasoning_is_kept_apart_unless_asked_not_to(client):
    text = "<think>\nThinking hard.\n</think>\n\nThe answer."
    body = {"messages": ASK, "max_tokens": 60, "extra_body": {"guided_choice": [text]}}
    r = client.chat.completions.create(model="tiny", **body)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == ("Thinking hard.", "The answer.")
    content, reasoning, _, finish = stream(client, **body)
    assert (reasoning, content, finish) == ("Thinking hard.", "The answer.", "stop")
    # SGLang's stream_reasoning false: the reasoning in one delta, before the answer
    chunks = [c.choices[0].delta for c in client.chat.completions.create(
        model="tiny", stream=True, messages=ASK, max_tokens=60,
        extra_body={"guided_choice": [text], "stream_reasoning": False})]
    said = [getattr(d, "reasoning_content", None) for d in chunks]
    assert [x for x in said if x] == ["Thinking hard."]
    first_content = next(i for i, d in enumerate(chunks) if d.content)
    assert said.index("Thinking hard.") < first_content
    body["extra_body"]["separate_reasoning"] = False
    r = client.chat.completions.create(model="tiny", **body)
    assert r.choices[0].message.content == text


def test_bad_tool_requests_are_400s_naming_the_field(client):
    openai = pytest.importorskip("openai")
    cases = [
        ({"tool_choice": "required"}, "tool_choice", "has no tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "not among the request's tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "given twice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "both constrain"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": 5}}}}}], "tool_choice": "required"},
         "tools", "grammar backend"),
    ]
    for extra, param, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, **extra)
        error = e.value.body
        assert error["param"] == param and words in error["message"], (extra, error)


# -- without a model ----------------------------------------------------------------------------
def _engine(tool_parser=None):
    return types.SimpleNamespace(tool_parser=tool_parser, reasoning_parser=None)


def _body(**fields):
    from engine.server.openai import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


def test_auto_without_a_parser_says_how_to_start_the_server():
    from engine.server.errors import APIError
    from engine.server.tool_choice import chat_tools

    with pytest.raises(APIError, match="--tool-call-parser NAME.*installed: hermes"):
        chat_tools(_engine(), _body(tools=TOOLS), None)
    # none, required and a named function need no parser
    assert chat_tools(_engine(), _body(tools=TOOLS, tool_choice="none"), None).tool_parser \
        is None
    forced = chat_tools(_engine(), _body(tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False), None)
    schema = json.loads(forced.constraint.spec)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert forced.constraint.field == "tools"


def test_parser_flags():
    from click.testing import CliRunner
    from engine_cli.main import cli

    out = CliRunner().invoke(cli, ["serve", "--tool-call-parser", "hermez"])
    assert out.exit_code == 2 and "Did you mean 'hermes'" in out.output
    assert "Registered: hermes" in out.output
    out = CliRunner().invoke(cli, ["serve", "--reasoning-parser", "deepseek"])
    assert out.exit_code == 2 and "deepseek-r1" in out.output
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        EngineConfig.from_kwargs(enable_auto_tool_choice=True)
    assert EngineConfig.from_kwargs(enable_auto_tool_choice=True,
                                    tool_call_parser="llama3_json").tool_call_parser
