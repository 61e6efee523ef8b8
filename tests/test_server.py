"""`engine serve` end to end: the official openai client, SSE, concurrency, disconnects, metrics,
and (at the end of the module) a graceful stop on SIGTERM with requests in flight.

One real server subprocess per module (tiny random llama, 4096 KV slots); every wait bounded.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
import torch
from engine.server.openai import ChatCompletionResponse, CompletionResponse, ModelList
from prometheus_client.parser import text_string_to_metric_families

KEY = "sk-test"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(start_server):
    s = start_server("--served-model-name", MODEL, "--shutdown-grace-period", "2", api_key=KEY)
    yield s
    stop_with_requests_in_flight(s)


def stop_with_requests_in_flight(s):
    """SIGTERM while two streams run: the short one finishes within the 2 s grace period, the
    long one (500 steps of 4 sequences) is cut when it runs out, and the server exits 0."""

    async def run(http, body, first_chunk):
        events = []
        try:
            async with http.stream("POST", s.url + "/v1/completions", json=body,
                                   headers=s.headers) as r:
                async for line in r.aiter_lines():
                    if line:
                        events.append(line)
                        first_chunk.set()
        except httpx.HTTPError as e:  # cut when the grace period ran out
            events.append(repr(e))
        return events

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            flags = [asyncio.Event(), asyncio.Event()]
            short = asyncio.ensure_future(run(http, {
                "prompt": "short", "max_tokens": 8, "ignore_eos": True, "stream": True},
                flags[0]))
            long = asyncio.ensure_future(run(http, {
                "prompt": "long", "max_tokens": 500, "n": 4, "ignore_eos": True,
                "stream": True},
                flags[1]))
            await asyncio.gather(*(f.wait() for f in flags))
            s.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            results = await asyncio.gather(short, long)
            return results, time.monotonic() - t0

    (short, long), elapsed = asyncio.run(asyncio.wait_for(main(), 60))
    assert s.proc.wait(30) == 0, s.log()[-3000:]
    assert short[-1] == "data: [DONE]", (short[-2:], elapsed)
    # the long one is cut or aborted when the grace period runs out; on a fast machine it may
    # also finish inside the grace period, which is just as right
    finished = long[-1] == "data: [DONE]" and '"finish_reason": "abort"' not in long[-2]
    assert not finished or elapsed < 2 + 1, (long[-2:], elapsed)
    assert elapsed < 15, elapsed


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def hf(tiny_model_factory):
    """The served checkpoint in HF transformers (float32, eager), and its tokenizer."""
    import transformers

    path = tiny_model_factory("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    return model, transformers.AutoTokenizer.from_pretrained(path)


def hf_greedy(hf, ids: list[int], n: int, penalize=None) -> tuple[list[int], list]:
    """HF's greedy continuation of ``ids``: the ``n`` tokens and, per step, the log-softmax of
    the raw logits. ``penalize(logits, prompt, output)`` edits the logits before the argmax."""
    model, _ = hf
    out, rows = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1].double()
            rows.append(torch.log_softmax(logits, -1))
            if penalize is not None:
                logits = penalize(logits.clone(), ids, out)
            out.append(int(logits.argmax()))
    return out, rows


def chat_ids(hf, messages: list[dict]) -> list[int]:
    """The prompt ids the chat route builds (the template writes its own BOS)."""
    tok = hf[1]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def get(server, path: str, **kw) -> httpx.Response:
    return httpx.get(server.url + path, headers=server.headers, timeout=30, **kw)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)


def metrics(server) -> dict[str, float]:
    """Sample name -> value (labels dropped: there is one model)."""
    out = {}
    for family in text_string_to_metric_families(get(server, "/metrics").text):
        for s in family.samples:
            if "le" not in s.labels:
                out[s.name] = s.value
    return out


def sse_events(response: httpx.Response) -> list:
    lines = [ln for ln in response.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]


def test_completion(client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hello there",
                                                      max_tokens=5, temperature=0)
    CompletionResponse.model_validate(raw.http_response.json())  # what /openapi.json declares
    out = raw.parse()
    assert out.model == MODEL and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 1


def test_chat_and_streaming_chat_agree(client):
    messages = [{"role": "user", "content": "Say something."}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                           max_tokens=12, temperature=0)
    ChatCompletionResponse.model_validate(raw.http_response.json())
    full = raw.parse()
    text = full.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n_choices(client):
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, n=3, seed=1)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, n=2)
    assert len(chat.choices) == 2


def test_logprobs(client, hf):
    out = client.completions.create(model=MODEL, prompt="The", max_tokens=4, logprobs=2,
                                    temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(x <= 0 for x in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(max(top, key=top.get) == tok for tok, top in zip(lp.tokens, lp.top_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    # the values are HF's log-softmax of the raw logits, chosen token and top 2 alike
    tok = hf[1]
    ids, rows = hf_greedy(hf, tok("The").input_ids, 4)
    for t, row, piece, value, top in zip(ids, rows, lp.tokens, lp.token_logprobs,
                                         lp.top_logprobs, strict=True):
        assert piece == tok.decode([t]) and value == pytest.approx(row[t].item(), abs=2e-4)
        best = row.topk(2)
        expected = {tok.decode([i]): v for i, v in zip(best.indices.tolist(),
                                                        best.values.tolist())}
        assert top.keys() == expected.keys()
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=2e-4)
    greedy_chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True,
        top_logprobs=2, temperature=0).choices[0].logprobs.content
    ids, rows = hf_greedy(hf, chat_ids(hf, [{"role": "user", "content": "x"}]), 3)
    for t, row, item in zip(ids, rows, greedy_chat, strict=True):
        assert item.token == tok.decode([t])
        assert item.logprob == pytest.approx(row[t].item(), abs=2e-4)
        best = row.topk(2)
        assert [x.token for x in item.top_logprobs] == [tok.decode([i]) for i in best.indices]
        assert [x.logprob for x in item.top_logprobs] == pytest.approx(best.values.tolist(),
                                                                      abs=2e-4)


def test_echo_logprobs_score_the_prompt(client, hf):
    """What loglikelihood harnesses do: the prompt's token logprobs via echo + max_tokens 0."""
    first = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=1,
                                      logprobs=1, temperature=0)
    ids = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=0, echo=True,
                                    logprobs=0).choices[0].logprobs
    assert ids.token_logprobs[0] is None and ids.top_logprobs[0] is None
    assert all(x <= 0 for x in ids.token_logprobs[1:])
    # each prompt token's logprob is HF's log-softmax at the position before it
    model, tok = hf
    prompt = tok("Once upon").input_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
    expected = [logprobs[i, t].item() for i, t in enumerate(prompt[1:])]
    assert ids.tokens == [tok.decode([t]) for t in prompt]
    assert ids.token_logprobs[1:] == pytest.approx(expected, abs=2e-4)
    scored = client.completions.create(model=MODEL, prompt="Once upon" + first.choices[0].text,
                                       max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == "Once upon" + first.choices[0].text
    if len(choice.logprobs.tokens) == len(ids.tokens) + 1:  # the text re-tokenized the same way
        expected = first.choices[0].logprobs.token_logprobs[0]
        assert choice.logprobs.token_logprobs[-1] == pytest.approx(expected, abs=1e-4)


def test_seed_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Seeded", max_tokens=8,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_seeded_requests_alone_and_in_a_crowd_agree(server):
    """A seeded sampled request gives the same text alone and inside a crowd of other requests
    (sampled, seeded, greedy, n > 1, other lengths) joining the same batches, on every route."""
    seeded = [("/v1/completions", {"prompt": "Seeded", "max_tokens": 10, "temperature": 1.0,
                                   "seed": 7}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Seeded"}],
                                        "max_tokens": 10, "temperature": 1.0, "seed": 7}),
              ("/generate", {"text": "Seeded", "sampling_params": {
                  "max_new_tokens": 10, "temperature": 1.0, "seed": 7}})]

    def text(path: str, answer: dict) -> str:
        if path == "/generate":
            return answer["text"]
        choice = answer["choices"][0]
        return choice["text"] if path == "/v1/completions" else choice["message"]["content"]

    alone = [text(path, post(server, path, body).json()) for path, body in seeded]
    crowd = []
    for i in range(24):
        body = {"prompt": f"crowd {i} " * (1 + i % 4), "max_tokens": 4 + i % 9,
                "ignore_eos": True, "temperature": [1.0, 0.0, 0.7][i % 3]}
        if i % 4 == 1:
            body["seed"] = i
        if i % 5 == 2:
            body["n"] = 2
        crowd.append(("/v1/completions", body))

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=server.headers) as http:
            async def send(path, body, delay):
                await asyncio.sleep(delay)
                r = await http.post(server.url + path, json=body)
                assert r.status_code == 200, r.text
                return text(path, r.json())

            first = [send(p, b, 0) for p, b in crowd[:12]]  # running when the seeded ones come
            mine = [send(p, b, 0.05) for p, b in seeded]
            later = [send(p, b, 0.1) for p, b in crowd[12:]]
            return await asyncio.gather(*first, *mine, *later)

    results = asyncio.run(asyncio.wait_for(main(), 120))
    assert results[12:15] == alone


def test_bad_request_is_an_openai_error(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
    assert "temperature" in info.value.message
    assert info.value.body["param"] == "temperature"


def test_stop_string_in_stream(server, client):
    prompt = "Stop here"
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2)
                 if text[i:i + 2].isprintable() and text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"no printable stop candidate in {text!r}")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stop": stop, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers,
                      timeout=60) as r:
        events = sse_events(r)
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert streamed == text[:text.index(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_generate_route(server):
    # ignore_eos: this request samples from the server's global RNG, whose draws depend on
    # every unseeded request before it, and an EOS would end it early
    one = post(server, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 3,
                                                                      "ignore_eos": True}})
    assert one.status_code == 200, one.text
    assert len(one.json()["output_ids"]) == 3
    batch = post(server, "/generate", {"input_ids": [[0, 5, 6], [0, 7]],
                                       "sampling_params": {"max_new_tokens": 2}}).json()
    assert [b["index"] for b in batch] == [0, 1]
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, headers=server.headers,
                      timeout=60) as r:
        events = sse_events(r)
    assert len(events[-1]["output_ids"]) == 3
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_info_routes(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    ModelList.model_validate(get(server, "/v1/models").json())
    info = get(server, "/get_server_info").json()
    assert info["max_total_tokens"] == 4096 and info["attention_backend"] == "cpu"
    assert info["sizing"]["max_total_tokens"] == 4096 and info["served_model_name"] == MODEL
    assert info["api_key"] == "<set>"
    assert get(server, "/health_generate").status_code == 200
    flushed = post(server, "/flush_cache", {})
    assert flushed.status_code == 200, flushed.text
    spec = get(server, "/openapi.json").json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
    assert "messages" in spec["components"]["schemas"][ref]["properties"]
    assert {"/v1/completions", "/generate", "/metrics", "/health"} <= set(spec["paths"])


def test_flush_cache_empties_the_prefix_cache(server):
    wait_idle(server)
    prompt = "A prompt long enough to leave a cached prefix behind it, " * 2

    def cached_tokens() -> int:
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached_tokens()
    assert cached_tokens() > 0
    flushed = post(server, "/flush_cache", {})
    assert flushed.status_code == 200 and flushed.json() == {"message": "Cache flushed."}
    state = get(server, "/get_server_info").json()["internal_states"][0]
    assert state["kv_pool"]["cached_slots"] == 0
    assert state["kv_pool"]["free_slots"] == state["kv_pool"]["total_slots"]
    assert cached_tokens() == 0


PENALTIES = {  # the sampler's rules, applied to HF's logits
    "presence_penalty": lambda x, prompt, out: x.index_add(
        0, torch.tensor(sorted(set(out)), dtype=torch.long),
        torch.full((len(set(out)),), -2.0, dtype=x.dtype)) if out else x,
    "frequency_penalty": lambda x, prompt, out: x.index_add(
        0, torch.tensor(out, dtype=torch.long),
        torch.full((len(out),), -2.0, dtype=x.dtype)) if out else x,
    "repetition_penalty": lambda x, prompt, out: _repetition(x, set(prompt + out), 3.0),
}
PENALTY_VALUES = {"presence_penalty": 2.0, "frequency_penalty": 2.0, "repetition_penalty": 3.0}


def _repetition(x, seen, penalty):
    idx = torch.tensor(sorted(seen), dtype=torch.long)
    v = x[idx]
    x[idx] = torch.where(v < 0, v * penalty, v / penalty)
    return x


def generated(server, route: str, prompt: str, params: dict) -> tuple[str, list | None]:
    """(text, output ids or None) of one request on ``route`` with sampling ``params``
    (SamplingParams names; max_new_tokens becomes max_tokens on the OpenAI routes)."""
    if route == "/generate":
        r = post(server, route, {"text": prompt, "sampling_params": params})
        assert r.status_code == 200, r.text
        return r.json()["text"], r.json()["output_ids"]
    body = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in params.items()}
    if route == "/v1/completions":
        r = post(server, route, {"prompt": prompt, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], None
    r = post(server, route, {"messages": [{"role": "user", "content": prompt}], **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], None


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_penalties_and_min_p_act_on_every_route(server, hf, route):
    """Each penalty changes the greedy text exactly as HF's logits, penalized by the sampler's
    rule, predict; min_p 1 at temperature 1 keeps only the most likely token: greedy, whatever
    the seed (and the same requests without it are not)."""
    tok = hf[1]
    prompt = "the the the of of"
    ids = (chat_ids(hf, [{"role": "user", "content": prompt}]) if route == "/v1/chat/completions"
           else tok(prompt).input_ids)
    n = 12
    base = {"max_new_tokens": n, "ignore_eos": True, "temperature": 0}
    plain, _ = hf_greedy(hf, ids, n)
    text, out = generated(server, route, prompt, base)
    assert text == tok.decode(plain, skip_special_tokens=True) and out in (None, plain)
    for name, rule in PENALTIES.items():
        expected, _ = hf_greedy(hf, ids, n, rule)
        assert expected != plain, name  # the prompt is one where the penalty matters
        text, out = generated(server, route, prompt, {**base, name: PENALTY_VALUES[name]})
        assert text == tok.decode(expected, skip_special_tokens=True), name
        assert out in (None, expected), name
    greedy = tok.decode(plain, skip_special_tokens=True)
    sampled = {**base, "temperature": 1.0}
    for seed in (1, 2, 3):
        assert generated(server, route, prompt, {**sampled, "min_p": 1.0, "seed": seed})[0] \
            == greedy, seed
    assert any(generated(server, route, prompt, {**sampled, "seed": seed})[0] != greedy
               for seed in (1, 2, 3))


def test_api_key(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.get(server.url + "/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert r.status_code == 401


def test_metrics_move(server, client):
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=6, temperature=0)
    after = metrics(server)
    assert after["engine:generation_tokens_total"] >= before["engine:generation_tokens_total"] + 6
    assert after["engine:prompt_tokens_total"] > before["engine:prompt_tokens_total"]
    for name in ("time_to_first_token", "e2e_request_latency", "inter_token_latency"):
        key = f"engine:{name}_seconds_count"
        assert after[key] > before[key], name
    assert after["engine:num_running_reqs"] == 0
    assert 0 <= after["engine:cache_hit_rate"] <= 1 and after["engine:gen_throughput"] >= 0


async def _stream(http: httpx.AsyncClient, server, body: dict, read_chunks: int | None = None):
    """Stream one completion; read it all, or only ``read_chunks`` events then hang up."""
    async with http.stream("POST", server.url + "/v1/completions", json=body,
                           headers=server.headers) as r:
        assert r.status_code == 200
        events = []
        async for line in r.aiter_lines():
            if line:
                events.append(line)
                if read_chunks is not None and len(events) >= read_chunks:
                    return events
        return events


def test_64_concurrent_streams(server):
    async def main():
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            bodies = [{"model": MODEL, "prompt": f"stream {i}", "max_tokens": 6,
                       "ignore_eos": True, "stream": True} for i in range(64)]
            return await asyncio.gather(*(_stream(http, server, b) for b in bodies))

    results = asyncio.run(asyncio.wait_for(main(), 150))
    assert len(results) == 64
    for events in results:
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_disconnects_free_everything(server):
    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            bodies = [{"model": MODEL, "prompt": f"leave {i}", "max_tokens": 400,
                       "ignore_eos": True, "stream": True} for i in range(12)]
            await asyncio.gather(*(_stream(http, server, b, read_chunks=2) for b in bodies))

    before = metrics(server)
    asyncio.run(asyncio.wait_for(main(), 60))
    m = wait_idle(server)
    aborted = "engine:num_aborted_requests_total"
    assert m[aborted] >= before[aborted] + 12
    assert m["engine:generation_tokens_total"] < before["engine:generation_tokens_total"] + 12 * 400


def wait_idle(server, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["engine:num_running_reqs"] == m["engine:num_queue_reqs"] == 0 and \
                m["engine:token_usage"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


def test_non_streaming_client_that_leaves_is_aborted(server):
    before = metrics(server)["engine:num_aborted_requests_total"]
    # 4 x 450 tokens: ~0.15 s of the tiny model on the CPU kernels with the CPU graph (450
    # tokens alone take 0.1 s); the client leaves after 0.02 s, long before
    body = {"prompt": "slow", "max_tokens": 450, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                   timeout=httpx.Timeout(30, read=0.02))
    # each of the n = 4 sequences counts
    assert wait_idle(server)["engine:num_aborted_requests_total"] == before + 4
