"""The engine thread only schedules: templating and tokenizing happen on the tokenizer threads
before a request reaches it, the streamed and returned text is made on the detokenizer thread
after it, and the only decoding left on the engine thread is the stop-string check of requests
that have stop strings (a window of a few tokens per token). Incremental detokenization costs
the same per token at the end of a long output as at its start (nothing re-joins the text)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from engine.sampling import IncrementalDetokenizer
from engine_testing.servers import InProcessServer

ENGINE_THREAD = "engine-loop"


class RecordingTokenizer:
    """A transformers tokenizer that records which thread calls encode / decode / templates
    (and the sizes involved); everything else is forwarded."""

    def __init__(self, tok):
        self._tok = tok
        self.calls: list[tuple[str, str, int, int]] = []  # (what, thread, ids in, chars out)
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def _record(self, what: str, n_in: int, n_out: int) -> None:
        with self._lock:
            self.calls.append((what, threading.current_thread().name, n_in, n_out))

    def encode(self, text, *args, **kwargs):
        ids = self._tok.encode(text, *args, **kwargs)
        self._record("encode", len(ids), len(text))
        return ids

    def decode(self, ids, *args, **kwargs):
        text = self._tok.decode(ids, *args, **kwargs)
        self._record("decode", len(ids) if isinstance(ids, list) else 1, len(text))
        return text

    def apply_chat_template(self, *args, **kwargs):
        self._record("apply_chat_template", 0, 0)
        return self._tok.apply_chat_template(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self._record("__call__", 0, 0)
        return self._tok(*args, **kwargs)

    def on(self, thread: str) -> list:
        with self._lock:
            return [c for c in self.calls if c[1] == thread]

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()


@pytest.fixture
def recorded(tiny_model_factory, single_torch_thread):
    """An in-process server whose engine's tokenizer records its callers' threads."""
    from engine import Engine

    engine = Engine(tiny_model_factory("llama", max_position_embeddings=2048),
                    max_total_tokens=4096)
    engine.tokenizer = RecordingTokenizer(engine.tokenizer)
    with InProcessServer(engine) as server:
        yield server, engine.tokenizer


def post(server, path: str, body: dict) -> httpx.Response:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def stream(server, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def streamed_text(events: list[dict]) -> str:
    return "".join(c.get("text", "") or (c.get("delta") or {}).get("content", "") or ""
                   for e in events for c in e.get("choices", []))


def test_the_engine_thread_never_calls_the_tokenizer_without_stop_strings(recorded):
    server, tok = recorded
    messages = [{"role": "user", "content": "Hello there"}]
    post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6})
    stream(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6,
                                            "logprobs": True, "top_logprobs": 2})
    post(server, "/v1/completions", {"prompt": "Once upon", "max_tokens": 6, "logprobs": 2,
                                     "n": 2})
    stream(server, "/v1/completions", {"prompt": ["Once upon", "a time"], "max_tokens": 6})
    post(server, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 6}})
    stream(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 6}})
    assert tok.on(ENGINE_THREAD) == []
    threads = {c[1] for c in tok.calls}
    assert "detokenizer" in threads and any(t.startswith("tokenizer") for t in threads), threads


def test_stop_strings_cost_a_window_of_a_few_tokens_on_the_engine_thread(recorded):
    server, tok = recorded
    tok.clear()
    n = 60
    events = stream(server, "/v1/completions", {
        "prompt": "Once upon", "max_tokens": n, "ignore_eos": True, "temperature": 0,
        "stop": ["\u2603 never", "\u00a7\u00a7"]})
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    on_engine = tok.on(ENGINE_THREAD)
    assert {c[0] for c in on_engine} == {"decode"}
    assert len(on_engine) <= 2 * n + 2  # two small windows per token (and the final flush)
    assert max(c[2] for c in on_engine) <= 8, on_engine  # ids per decode: a few tokens
    # no other request decodes there: a stream without stop strings next to it adds nothing
    tok.clear()
    stream(server, "/v1/completions", {"prompt": "Once upon", "max_tokens": 20,
                                       "ignore_eos": True})
    assert tok.on(ENGINE_THREAD) == []


def test_streaming_costs_the_same_per_token_at_the_end_as_at_the_start(recorded, monkeypatch):
    """Nothing re-joins the text emitted so far (the old stream_delta joined it every step:
    quadratic in the output); every decode is a window of a few tokens."""
    server, tok = recorded
    joined = []
    real_text = IncrementalDetokenizer.text

    def counting_text(self):
        out = real_text.fget(self)
        joined.append(len(out))
        return out

    monkeypatch.setattr(IncrementalDetokenizer, "text", property(counting_text))
    tok.clear()
    n = 1500
    for body in ({"prompt": "Once", "stop": ["\u2603 never"]}, {"prompt": "Once"}):
        events = stream(server, "/v1/completions", {**body, "max_tokens": n,
                                                    "ignore_eos": True})
        text = streamed_text(events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0].get("text", "")) for e in events) == len(text) > n // 2
    assert sum(joined) <= 2 * len(text), (len(joined), sum(joined))  # not once per step
    decodes = [c for c in tok.calls if c[0] == "decode"]
    assert max(c[2] for c in decodes) <= 12  # ids per decode
    for thread in (ENGINE_THREAD, "detokenizer"):
        calls = [c for c in decodes if c[1] == thread]
        tenth = len(calls) // 10
        start = sum(c[2] + c[3] for c in calls[:tenth]) / tenth
        end = sum(c[2] + c[3] for c in calls[-tenth:]) / tenth
        assert end < 2 * start + 4, (thread, start, end)  # ids + chars decoded per call


def test_stop_strings_stop_at_the_same_token_offline_streamed_and_not(tiny_model_factory,
                                                                   single_torch_thread):
    from engine import Engine

    engine = Engine(tiny_model_factory("llama"), max_total_tokens=4096)
    prompt = "The quick brown"
    greedy = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    full = engine.generate(prompt, greedy)
    text = full["text"]
    at = next(i for i in range(8, len(text) - 4) if text[i:i + 3].strip() and
              text.find(text[i:i + 3]) == i)
    stop = text[at:at + 3]
    offline = engine.generate(prompt, {**greedy, "stop": ["\u2603", stop]})
    assert offline["text"] == text[:at]
    assert offline["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    stopped_after = len(offline["output_ids"])
    assert stopped_after < 48
    with InProcessServer(engine) as server:
        body = {"prompt": prompt, "max_tokens": 48, "ignore_eos": True, "temperature": 0,
                "stop": ["\u2603", stop]}
        whole = post(server, "/v1/completions", body).json()
        events = stream(server, "/v1/completions", body)
        gen = post(server, "/generate", {"text": prompt, "sampling_params": {
            **greedy, "stop": ["\u2603", stop]}}).json()
    assert whole["choices"][0]["text"] == streamed_text(events) == gen["text"] == text[:at]
    assert whole["choices"][0]["matched_stop"] == events[-1]["choices"][0]["matched_stop"] \
        == stop
    assert whole["usage"]["completion_tokens"] == stopped_after
    assert gen["output_ids"] == offline["output_ids"]
    # without stop strings the texts agree with the offline one too
    with InProcessServer(engine) as server:
        body = {"prompt": prompt, "max_tokens": 48, "ignore_eos": True, "temperature": 0}
        assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == text
        assert streamed_text(stream(server, "/v1/completions", body)) == text


def test_only_requests_with_stop_strings_get_an_engine_side_detokenizer(tiny_model_factory):
    from engine import Engine

    engine = Engine(tiny_model_factory("llama"), max_total_tokens=1024)
    plain = engine.add_request([5, 6, 7], {"max_new_tokens": 2}, stream=True)[0]
    stops = engine.add_request([5, 6, 7], {"max_new_tokens": 2, "stop": ["x"]})[0]
    assert plain.detokenizer is None and stops.detokenizer is not None
    while engine.scheduler.has_work:
        engine.step()


def test_take_returns_each_emitted_piece_once(tiny_tokenizer):
    from engine.sampling import SamplingParams

    ids = tiny_tokenizer.encode("Some text with é and 日本 in it, and more",
                                add_special_tokens=False)
    det = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams(stop=["日本"]))
    taken = []
    for t in ids:
        det.add([t])
        taken.append(det.take())
    det.finish()
    taken.append(det.take())
    assert "".join(taken) == det.text == "Some text with é and "
    assert det.length == len(det.text) and det.matched_stop == "日本"


@pytest.mark.parametrize("skip", [True, False])
def test_one_decode_per_token_gives_the_same_text_as_two(tiny_tokenizer, smollm2_tokenizer,
                                                        skip):
    """With a byte-level decoder the detokenizer reuses the last delta as the next window's
    known text (one decode per token instead of two): same deltas, random tokens included
    (broken characters, special tokens)."""
    import random

    from engine.sampling import SamplingParams
    from engine.sampling.detokenizer import window_decoder

    for tok in (tiny_tokenizer, smollm2_tokenizer):
        fast = window_decoder(tok)
        assert fast.concatenative

        def two(ids, skip_special, tok=tok):  # the general path: no reuse
            return tok.decode(ids, skip_special_tokens=skip_special,
                              clean_up_tokenization_spaces=False)

        rng = random.Random(0)
        for trial in range(20):
            if trial % 2:
                ids = [rng.randrange(len(tok)) for _ in range(200)]
            else:
                ids = tok.encode("Zürich 日本語 😀 naïve ✓ " * 8, add_special_tokens=False)
            params = SamplingParams(skip_special_tokens=skip, stop=["日本", "\u2603"])
            a = IncrementalDetokenizer(tok, [3, 4], params)
            b = IncrementalDetokenizer(tok, [3, 4], params, decode=two)
            for t in ids:
                assert a.add([t]) == b.add([t])
            assert a.finish() == b.finish() and a.text == b.text
            assert a.matched_stop == b.matched_stop
