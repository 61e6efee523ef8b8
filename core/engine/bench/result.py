"""What a benchmark run measured: per request (client side), a timeline of the engine's state,
and the summary SGLang's bench_serving prints (plus token usage, queue, retractions, cache hits).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    input_len: int
    output_len: int  # asked for
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds from sending to the first token
    latency: float = 0.0  # seconds from sending to the last token
    itls: list[float] = field(default_factory=list)  # gaps between tokens (or chunks)
    output_tokens: int = 0  # received


@dataclass
class Sample:
    """The engine's state at ``t`` seconds into the run; ``output_tokens``: received so far."""

    t: float
    token_usage: float | None
    num_queue_reqs: float | None
    num_running_reqs: float | None
    output_tokens: int


@dataclass
class BenchResult:
    mode: str  # "serve" or "offline"
    dataset_name: str
    request_rate: float
    max_concurrency: int | None
    completed: int
    failed: int
    errors: list[str]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    ttft_ms: dict[str, float]  # mean, median, p90, p99
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    peak_token_usage: float | None
    mean_token_usage: float | None
    mean_queue_reqs: float | None
    peak_queue_reqs: float | None
    retractions: int | None
    cache_hit_rate: float | None
    peak_in_flight: int  # requests the client had sent and not finished, at most
    timeline: list[Sample] = field(default_factory=list)

    def to_dict(self, timeline: bool = True) -> dict:
        d = dataclasses.asdict(self)
        if not timeline:
            d.pop("timeline")
        return _finite(d)

    def to_json(self, timeline: bool = True) -> str:
        return json.dumps(self.to_dict(timeline))


def _finite(x):
    """inf / nan as strings ("inf"), which strict JSON has no numbers for."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {k: float("nan") for k in ("mean", "median", "p90", "p99")}
    a = np.asarray(values) * 1e3
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(mode: str, workload, max_concurrency: int | None, results: list[RequestResult],
              duration: float, timeline: list[Sample], retractions: int | None,
              cache_hit_rate: float | None, peak_in_flight: int) -> BenchResult:
    ok = [r for r in results if r.ok]
    usage = [s.token_usage for s in timeline if s.token_usage is not None]
    queue = [s.num_queue_reqs for s in timeline if s.num_queue_reqs is not None]
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = 1 / duration if duration > 0 else 0.0
    return BenchResult(
        mode, workload.dataset_name, workload.request_rate, max_concurrency, len(ok),
        len(results) - len(ok), sorted({r.error for r in results if not r.ok})[:5], duration,
        total_in, total_out, len(ok) * per_s, total_in * per_s, total_out * per_s,
        stats_ms([r.ttft for r in ok]), stats_ms([x for r in ok for x in r.itls]),
        stats_ms([r.latency for r in ok]),
        max(usage) if usage else None, float(np.mean(usage)) if usage else None,
        float(np.mean(queue)) if queue else None, max(queue) if queue else None,
        retractions, cache_hit_rate, peak_in_flight, timeline)


def _opt(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def format_table(r: BenchResult) -> str:
    """SGLang's bench_serving summary, with our engine-state lines."""
    title = "Serving" if r.mode == "serve" else "Offline"
    rows = [("Backend:", "engine serve" if r.mode == "serve" else "engine (in-process)"),
            ("Dataset:", r.dataset_name),
            ("Traffic request rate:", "inf" if r.request_rate == math.inf else r.request_rate),
            ("Max request concurrency:", r.max_concurrency or "not set"),
            ("Successful requests:", r.completed),
            ("Failed requests:", r.failed),
            ("Benchmark duration (s):", f"{r.duration_s:.2f}"),
            ("Total input tokens:", r.total_input_tokens),
            ("Total generated tokens:", r.total_output_tokens),
            ("Request throughput (req/s):", f"{r.request_throughput:.2f}"),
            ("Input token throughput (tok/s):", f"{r.input_throughput:.2f}"),
            ("Output token throughput (tok/s):", f"{r.output_throughput:.2f}")]
    for name, d in (("TTFT", r.ttft_ms), ("ITL", r.itl_ms), ("E2E Latency", r.e2e_ms)):
        rows += [(f"Mean {name} (ms):", f"{d['mean']:.2f}"),
                 (f"Median {name} (ms):", f"{d['median']:.2f}"),
                 (f"P99 {name} (ms):", f"{d['p99']:.2f}")]
    rows += [("Peak token usage:", _opt(r.peak_token_usage, ".2f")),
             ("Mean token usage:", _opt(r.mean_token_usage, ".2f")),
             ("Mean #queue-req:", _opt(r.mean_queue_reqs, ".2f")),
             ("Retractions:", _opt(r.retractions, "d")),
             ("Cache hit rate:", _opt(r.cache_hit_rate, ".2f"))]
    bar = "=" * 50
    lines = [f"{f' {title} Benchmark Result ':=^50}"]
    lines += [f"{k:<40} {v}" for k, v in rows]
    lines += [bar] + [f"error: {e}" for e in r.errors]
    return "\n".join(lines)
