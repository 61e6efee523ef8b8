"""Structured outputs over HTTP (a real client against the in-process server): OpenAI's
response_format, SGLang's json_schema / regex / ebnf, vLLM's guided_*; a constraint compiled
before the request is queued, so a bad one is a 400 naming its field; and, with the xgrammar
plugin and the default model, outputs that validate against their schema / match their regex."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import sys
import time

import httpx
import pytest

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
sys.path.insert(0, FIXTURES)
import engine_grammar_toy as toy  # noqa: E402

from engine import Engine  # noqa: E402
from engine_testing.servers import InProcessServer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    with toy.registered_globally(toy, "toy_grammar"):
        engine = Engine(tiny_model_factory("llama"), max_total_tokens=4000,
                        grammar_backend="toy_choice")
    with InProcessServer(engine) as s:
        yield s


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def chat(content="Pick one.", **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 30, **extra}


def test_guided_choice_on_chat_and_completions_stops_with_one_of_the_choices(server):
    r = post(server, "/v1/chat/completions", chat(guided_choice=["red", "green"], n=3,
                                                  temperature=1.0, seed=4))
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["message"]["content"] in ("red", "green")
        assert c["finish_reason"] == "stop"
    r = post(server, "/v1/completions", {"prompt": "Colour:", "max_tokens": 30,
                                         "guided_choice": ["cyan", "magenta"], "n": 2})
    assert r.status_code == 200, r.text
    assert {c["text"] in ("cyan", "magenta") for c in r.json()["choices"]} == {True}
    assert r.json()["usage"]["completion_tokens"] < 60


def test_streamed_constrained_chat(server):
    body = chat(guided_choice=["north", "south"], stream=True)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text in ("north", "south")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("route,body,param,words", [
    ("/v1/chat/completions", chat(guided_choice=["é"]), "guided_choice", "cannot be spelled"),
    ("/v1/chat/completions", chat(response_format={"type": "json_object"}), "response_format",
     "does not support json_object"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}), "response_format.json_schema.schema",
     "does not support json_schema"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "[0-9]+"}, "guided_regex",
     "does not support regex"),
    ("/v1/completions", {"prompt": "a", "regex": "a", "guided_json": {"type": "object"}},
     "guided_json", "regex and guided_json both constrain the output"),
    ("/generate", {"text": "a", "sampling_params": {"ebnf": "root ::= \"a\""}},
     "sampling_params.ebnf", "does not support ebnf"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema"}),
     "response_format.json_schema", "needs a json_schema object"),
])
def test_a_constraint_the_backend_refuses_is_a_400_naming_the_field(server, route, body, param,
                                                                    words):
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    if "both" not in words and "needs" not in words:
        assert "grammar backend 'toy_choice'" in error["message"]
    assert not server.on_engine(lambda e: e.scheduler.has_work)  # never queued


def test_with_structured_outputs_off_a_constraint_is_a_400(server, monkeypatch):
    monkeypatch.setattr(server.engine, "grammar", None)
    monkeypatch.setattr(server.engine.config, "grammar_backend", "none")
    r = post(server, "/v1/completions", {"prompt": "a", "guided_choice": ["x"]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "guided_choice"
    assert "--grammar-backend none" in r.json()["error"]["message"]


def test_a_slow_compile_does_not_hold_up_other_requests(server):
    backend = server.engine.grammar.backend
    backend.compile_delay = 3.0
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            slow = pool.submit(post, server, "/v1/completions",
                               {"prompt": "a", "guided_choice": ["up", "down"], "max_tokens": 20})
            time.sleep(0.3)
            start = time.monotonic()
            fast = post(server, "/v1/completions", {"prompt": "b", "max_tokens": 3})
            took = time.monotonic() - start
            assert fast.status_code == 200 and not slow.done() and took < 2.5
            assert slow.result(timeout=60).json()["choices"][0]["text"] in ("up", "down")
    finally:
        backend.compile_delay = 0.0


# -- end to end: the xgrammar plugin and the default model ----------------------------------------
def _xgrammar_plugin():
    """The xgrammar plugin module: installed (entry point) or from plugins/grammar_xgrammar."""
    try:
        import engine_grammar_xgrammar
    except ImportError:
        path = os.path.join(ROOT, "plugins", "grammar_xgrammar")
        if not os.path.isdir(os.path.join(path, "engine_grammar_xgrammar")):
            pytest.skip("the xgrammar plugin (plugins/grammar_xgrammar) is not there")
        sys.path.insert(0, path)
        import engine_grammar_xgrammar
    reason = engine_grammar_xgrammar.check()
    if reason:
        pytest.skip(f"xgrammar plugin unusable here: {reason}")
    return engine_grammar_xgrammar


@pytest.fixture(scope="module")
def smollm2():
    from engine.plugins import get_registries

    if "xgrammar" in get_registries().grammar:
        engine = Engine(max_total_tokens=8192, grammar_backend="xgrammar")
    else:
        with toy.registered_globally(_xgrammar_plugin(), "grammar_xgrammar_from_tree"):
            engine = Engine(max_total_tokens=8192, grammar_backend="xgrammar")
    with InProcessServer(engine, served_model_name="smollm2") as s:
        yield s


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de"]},
                  "maxItems": 3}},
    "required": ["name", "age", "languages"], "additionalProperties": False}


def test_smollm2_json_schema_outputs_validate(smollm2):
    jsonschema = pytest.importorskip("jsonschema")
    body = chat("Describe a person as JSON.", max_tokens=120, n=3, temperature=0.9, seed=1,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": PERSON}})
    r = post(smollm2, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), PERSON)


def test_smollm2_regex_output_fully_matches_and_neighbours_keep_their_output(smollm2):
    pattern = r"[0-9]{3}-[0-9]{4}"
    free = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.7,
            "seed": 5}
    alone = post(smollm2, "/v1/completions", free).json()["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(post, smollm2, "/generate", {
            "text": "Call me at ", "sampling_params": {"regex": pattern, "max_new_tokens": 20}})
        neighbour = pool.submit(post, smollm2, "/v1/completions", free)
        out = constrained.result(timeout=120).json()
        assert neighbour.result(timeout=120).json()["choices"][0]["text"] == alone
    assert re.fullmatch(pattern, out["text"]), out
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "guided_regex": "([0-9]"}, "guided_regex"),
    ({"prompt": "a", "json_schema": "{not json"}, "json_schema"),
    ({"prompt": "a", "guided_json": {"type": "object", "properties": {"a": {"type": 5}}}},
     "guided_json"),
])
def test_smollm2_malformed_constraints_are_400s_with_xgrammars_message(smollm2, body, param):
    r = post(smollm2, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "grammar backend 'xgrammar'" in error["message"], error
