"""Prometheus metrics for /metrics: one CollectorRegistry per server, fed on the engine thread.

The names mirror SGLang's (``sglang:`` becomes ``engine:``) so that existing dashboards only
need the prefix changed; vLLM's dashboards get theirs too (``vllm:`` becomes ``engine:``):
``num_preemptions_total`` (our retractions) and ``gpu_cache_usage_perc`` /
``kv_cache_usage_perc`` (used KV slots / total, 0 to 1, as vLLM reports it). Gauges are refreshed from the scheduler after every step and every
batch of commands (an abort changes token usage without a step); counters are advanced by the
difference of the scheduler's cumulative Counters, and the latency samples it collects are
drained into histograms.
"""

from __future__ import annotations

import collections
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the route)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
THROUGHPUT_WINDOW_S = 10.0


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(f"engine:{name}", doc, labels, registry=registry).labels(model_name)

        def counter(name, doc):
            return Counter(f"engine:{name}", doc, labels, registry=registry).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"engine:{name}", doc, labels, buckets=buckets,
                             registry=registry).labels(model_name)

        self.running = gauge("num_running_reqs", "Requests in the running batch.")
        self.queued = gauge("num_queue_reqs", "Requests waiting to be scheduled.")
        self.used_tokens = gauge("num_used_tokens", "KV slots held by running requests.")
        self.token_usage = gauge("token_usage", "Used KV slots / total KV slots.")
        # vLLM's names for the same (the older and the newer spelling)
        self.gpu_cache_usage = gauge("gpu_cache_usage_perc", "KV-cache usage, 1 = 100% (vLLM's "
                                                             "name for token_usage).")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage, 1 = 100% (vLLM's "
                                                           "name for token_usage).")
        self.gen_throughput = gauge("gen_throughput",
                                    f"Generated tokens per second over the last "
                                    f"{THROUGHPUT_WINDOW_S:g} s.")
        self.cache_hit_rate = gauge("cache_hit_rate",
                                    "Prompt tokens served from the prefix cache / prompt tokens.")
        self.retracted = counter("num_retracted_reqs", "Requests retracted when decode ran out "
                                                       "of KV slots.")
        self.preemptions = counter("num_preemptions", "Cumulative preemptions (vLLM's name for "
                                                      "retractions).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the cache.")
        self.finished = counter("num_requests", "Requests finished (any reason).")
        self.aborted = counter("num_aborted_requests", "Requests aborted (client gone, shutdown).")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a "
                                                             "request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.spec_drafted = counter("spec_decode_num_draft_tokens", "Draft tokens verified "
                                                              "(speculative decoding).")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted "
                                                                 "(speculative decoding).")
        # HiCache's tiers (engine/hicache): prompt tokens served per tier, bytes moved per
        # direction (device->host, host->device, host->storage, storage->device)
        self.tier_hits = Counter("engine:cache_hit_tokens", "Prompt tokens served from each "
                                 "cache tier (device, host, storage).", ["model_name", "tier"],
                                 registry=registry)
        self.tier_bytes = Counter("engine:hicache_bytes_moved", "Bytes of K/V moved between "
                                  "cache tiers.", ["model_name", "direction"], registry=registry)
        self._model_name = model_name
        self._tiers_seen: dict = {}
        # what was left after the weights, the KV pool and the graphs (SGLang's gauge on a GPU;
        # the RAM left on a CPU): the tuning guide's "5-8 GB is good"
        self.available_at_start = gauge("startup_available_memory_gb", "Memory (GiB) available "
                                        "once the weights, KV pool and graphs were in place.")
        self.available_gpu_at_start = gauge("startup_available_gpu_memory_gb",
                                            "GPU memory (GiB) available after start (SGLang's "
                                            "name; 0 on a CPU).")
        self._seen = dict.fromkeys(_COUNTED, 0)
        self._spec_seen = (0, 0)
        self._history = collections.deque()  # (time, generation tokens so far)

    def started(self, engine) -> None:
        """The engine's start-time figures."""
        available = getattr(engine, "available_memory", 0) / (1 << 30)
        self.available_at_start.set(available)
        self.available_gpu_at_start.set(available if engine.device.is_cuda else 0.0)

    def sync(self, scheduler) -> None:
        """Bring every metric up to date with ``scheduler`` (call on the engine thread)."""
        c = scheduler.counters
        self.running.set(len(scheduler.running))
        self.queued.set(len(scheduler.waiting))
        used, total = scheduler.num_used_tokens, scheduler.kv.pool.size
        self.used_tokens.set(used)
        usage = used / total if total else 0.0
        for gauge in (self.token_usage, self.gpu_cache_usage, self.kv_cache_usage):
            gauge.set(usage)
        self.cache_hit_rate.set(c.cache_hit_rate)
        for attr, names in _COUNTED.items():
            value = getattr(c, attr)
            if value > self._seen[attr]:
                for name in names:
                    getattr(self, name).inc(value - self._seen[attr])
                self._seen[attr] = value
        for samples, histogram in ((c.ttft, self.ttft), (c.e2e, self.e2e)):
            for x in samples:
                histogram.observe(x)
            samples.clear()
        self._update_throughput(c.generation_tokens)
        self._sync_tiers(getattr(scheduler.kv, "stats", None))
        spec = getattr(scheduler, "spec", None)
        if spec is not None:
            drafted, accepted = spec.stats.drafted, spec.stats.accepted
            self.spec_drafted.inc(drafted - self._spec_seen[0])
            self.spec_accepted.inc(accepted - self._spec_seen[1])
            self._spec_seen = (drafted, accepted)

    def _sync_tiers(self, stats) -> None:
        if stats is None:
            return
        for metric, label, values in ((self.tier_hits, "tier", stats.hits),
                                      (self.tier_bytes, "direction", stats.bytes)):
            for name, value in list(values.items()):
                seen = self._tiers_seen.get((label, name), 0)
                if value > seen or (label, name) not in self._tiers_seen:
                    metric.labels(self._model_name, name).inc(value - seen)
                    self._tiers_seen[(label, name)] = value

    def _update_throughput(self, total: int) -> None:
        now = time.monotonic()
        h = self._history
        h.append((now, total))
        while len(h) > 2 and now - h[1][0] > THROUGHPUT_WINDOW_S:
            h.popleft()
        t0, n0 = h[0]
        self.gen_throughput.set((total - n0) / (now - t0) if now > t0 else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# Counters attribute -> the metric attributes it advances
_COUNTED = {"retracted_reqs": ("retracted", "preemptions"), "prompt_tokens": ("prompt_tokens",),
            "generation_tokens": ("generation_tokens",), "cached_tokens": ("cached_tokens",),
            "finished_reqs": ("finished",), "aborted_reqs": ("aborted",)}
