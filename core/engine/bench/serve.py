"""`engine bench serve`'s side: a streaming async client against a running server, requests sent
at their arrival times (at most ``max_concurrency`` in flight), the server's /metrics sampled
every ``sample_interval`` seconds for the timeline.

Backends, as SGLang's bench_serving names them: ``sglang`` streams /generate (every chunk says
how many tokens the request has, so ITL is per token); ``openai`` streams /v1/completions (a
chunk per piece of text, as every OpenAI client sees it).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from engine.bench.result import BenchResult, RequestResult, Sample, summarize
from engine.bench.workloads import BenchRequest
from engine.errors import EngineError

BACKENDS = ("sglang", "openai")
SAMPLE_INTERVAL_S = 0.5
# /metrics sample -> how several label sets (dp replicas) combine
GAUGES = {"engine:token_usage": "mean", "engine:num_queue_reqs": "sum",
          "engine:num_running_reqs": "sum"}
COUNTERS = ("engine:num_retracted_reqs_total", "engine:prompt_tokens_total",
            "engine:cached_tokens_total")


def parse_metrics(text: str) -> dict[str, float]:
    """The samples named in GAUGES and COUNTERS from a Prometheus text page; label sets of one
    name summed (a mean for usage). Names the page lacks are absent."""
    seen: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in GAUGES or name in COUNTERS:
            seen.setdefault(name, []).append(float(line.rsplit(" ", 1)[1]))
    return {k: (sum(v) / len(v) if GAUGES.get(k) == "mean" else sum(v)) for k, v in seen.items()}


class Tally:
    """What the client has in flight and has received, for the sampler and the progress bar."""

    def __init__(self, progress=None):
        self.in_flight = self.peak_in_flight = self.output_tokens = 0
        self.progress = progress

    def sent(self) -> None:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def done(self) -> None:
        self.in_flight -= 1
        if self.progress is not None:
            self.progress.update(1)


def _body(backend: str, model: str, req: BenchRequest) -> tuple[str, dict]:
    if backend == "sglang":
        key = "text" if isinstance(req.prompt, str) else "input_ids"
        return "/generate", {key: req.prompt, "stream": True, "sampling_params": {
            "max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}}
    return "/v1/completions", {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
                               "temperature": 0.0, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}


def _tokens_in(backend: str, chunk: dict, before: int) -> tuple[int, bool]:
    """(the request's token count after ``chunk``, whether the chunk brought tokens); an
    OpenAI usage chunk only corrects the count (a text chunk may hold several tokens)."""
    if backend == "sglang":
        n = (chunk.get("meta_info") or {}).get("completion_tokens", before)
        return n, n > before
    choices = chunk.get("choices") or []
    if choices and choices[0].get("text"):
        return before + 1, True
    return (chunk.get("usage") or {}).get("completion_tokens", before), False


async def send(client: httpx.AsyncClient, url: str, backend: str, model: str,
               req: BenchRequest, tally: Tally) -> RequestResult:
    """One streamed request; TTFT, ITLs and latency from the chunks as they arrive."""
    path, body = _body(backend, model, req)
    res = RequestResult(req.input_len, req.output_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread())[:300].decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error']}"
                    return res
                tokens, timed = _tokens_in(backend, chunk, res.output_tokens)
                tally.output_tokens += tokens - res.output_tokens
                if not timed:
                    res.output_tokens = tokens
                    continue
                now = time.perf_counter()
                if res.output_tokens == 0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                res.output_tokens, last = tokens, now
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "the stream ended without a token"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    try:
        r = await client.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    return parse_metrics(r.text) if r.status_code == 200 else {}


async def _sampler(client, url: str, tally: Tally, start: float, out: list[Sample],
                   interval: float) -> None:
    while True:
        m = await _scrape(client, url)
        out.append(Sample(time.perf_counter() - start, m.get("engine:token_usage"),
                          m.get("engine:num_queue_reqs"), m.get("engine:num_running_reqs"),
                          tally.output_tokens))
        await asyncio.sleep(interval)


async def served_model(url: str) -> dict:
    """The first card of /v1/models (``id``: the name to send, ``root``: the model's path)."""
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            r = await client.get(url + "/v1/models")
            return r.json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise EngineError(f"{url}/v1/models did not name a model ({type(e).__name__}: "
                              f"{e}); is --base-url an engine (or OpenAI-compatible) server?")


async def run_serve(url: str, requests: list[BenchRequest], workload, *, backend: str = "sglang",
                    model: str = "", max_concurrency: int | None = None, progress=None,
                    timeout: float = 600.0,
                    sample_interval: float = SAMPLE_INTERVAL_S) -> BenchResult:
    """Send ``requests`` to the server at ``url``; the BenchResult of the run."""
    if backend not in BACKENDS:
        raise EngineError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}.")
    url = url.rstrip("/")
    tally = Tally(progress)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limit = max_concurrency or len(requests) or 1
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeline: list[Sample] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client, \
            httpx.AsyncClient(timeout=10) as side:
        before = await _scrape(side, url)
        start = time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + req.arrival - time.perf_counter()))
            if sem is not None:
                await sem.acquire()
            tally.sent()
            try:
                return await send(client, url, backend, model, req, tally)
            finally:
                tally.done()
                if sem is not None:
                    sem.release()

        sampler = asyncio.create_task(_sampler(side, url, tally, start, timeline,
                                               sample_interval))
        try:
            results = await asyncio.gather(*(one(r) for r in requests))
        finally:
            sampler.cancel()
        duration = time.perf_counter() - start
        after = await _scrape(side, url)
    timeline.append(Sample(duration, after.get("engine:token_usage"),
                           after.get("engine:num_queue_reqs"),
                           after.get("engine:num_running_reqs"), tally.output_tokens))
    return summarize("serve", workload, max_concurrency, results, duration, timeline,
                     *_counter_deltas(before, after), tally.peak_in_flight)


def _counter_deltas(before: dict, after: dict) -> tuple[int | None, float | None]:
    """(retractions, cache hit rate) of the run, from the counters before and after it."""
    def delta(name):
        return after[name] - before.get(name, 0.0) if name in after else None

    retracted = delta("engine:num_retracted_reqs_total")
    prompt, cached = delta("engine:prompt_tokens_total"), delta("engine:cached_tokens_total")
    hit = cached / prompt if prompt and cached is not None else (0.0 if prompt == 0 else None)
    return (None if retracted is None else int(round(retracted))), hit

