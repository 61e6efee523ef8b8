"""`engine bench offline`'s side: an in-process Engine stepped by this thread, requests added at
their arrival times (at most ``max_concurrency`` unfinished), the scheduler sampled after every
step: no HTTP, so what it measures is the engine alone."""

from __future__ import annotations

import time

from engine.bench.result import BenchResult, RequestResult, Sample, summarize
from engine.bench.workloads import BenchRequest
from engine.errors import EngineError


def _sample(sched, t: float, tokens: int) -> Sample:
    total = sched.kv.pool.size
    return Sample(t, sched.num_used_tokens / total if total else 0.0, len(sched.waiting),
                  len(sched.running), tokens)


def run_offline(engine, requests: list[BenchRequest], workload, *,
                max_concurrency: int | None = None, progress=None) -> BenchResult:
    """Run ``requests`` through ``engine`` (which must be idle); the BenchResult of the run."""
    sched = engine.scheduler
    if sched.has_work:
        raise EngineError("the engine already has requests; bench an idle engine.")
    params = [{"max_new_tokens": r.output_len, "temperature": 0.0, "ignore_eos": True}
              for r in requests]
    for i, (r, p) in enumerate(zip(requests, params)):  # refuse before running anything
        try:
            engine.check_request(engine.tokenize(r.prompt), engine.make_params(p))
        except ValueError as e:
            raise EngineError(f"workload request {i} ({r.input_len} tokens in, {r.output_len} "
                              f"out): {e}") from None
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    results = [RequestResult(r.input_len, r.output_len) for r in requests]
    c0 = sched.counters
    retracted0, prompt0, cached0 = c0.retracted_reqs, c0.prompt_tokens, c0.cached_tokens
    live: dict = {}  # Req -> (its RequestResult, sent at, last token at)
    timeline: list[Sample] = []
    tokens = peak = 0
    start = time.perf_counter()
    while order or live:
        now = time.perf_counter()
        while order and requests[order[0]].arrival <= now - start and (
                max_concurrency is None or len(live) < max_concurrency):
            i = order.pop(0)
            (req,) = engine.add_request(requests[i].prompt, params[i])
            live[req] = [results[i], now, now]
            peak = max(peak, len(live))
        if sched.has_work:
            engine.step()
        elif order:  # nothing to run until the next arrival
            time.sleep(max(0.0, min(start + requests[order[0]].arrival - now, 0.05)))
            continue
        now = time.perf_counter()
        for req, entry in list(live.items()):
            res, sent, last = entry
            n = len(req.output_ids)
            if n > res.output_tokens:
                if res.output_tokens == 0:
                    res.ttft = now - sent
                else:
                    res.itls.append(now - last)
                tokens += n - res.output_tokens
                res.output_tokens, entry[2] = n, now
            if req.finished:
                res.latency, res.ok = now - sent, req.finish_reason != "abort"
                res.error = "" if res.ok else "aborted"
                del live[req]
                if progress is not None:
                    progress.update(1)
        timeline.append(_sample(sched, now - start, tokens))
    duration = time.perf_counter() - start
    c = sched.counters
    prompt = c.prompt_tokens - prompt0
    hit = (c.cached_tokens - cached0) / prompt if prompt else 0.0
    return summarize("offline", workload, max_concurrency, results, duration, timeline,
                     c.retracted_reqs - retracted0, hit, peak)
