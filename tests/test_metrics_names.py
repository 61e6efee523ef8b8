"""/metrics names: SGLang's with our prefix, and vLLM's for the same quantities (its dashboards
read num_preemptions_total and gpu_cache_usage_perc / kv_cache_usage_perc)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from engine.server.metrics import ServerMetrics
from engine.stats import Counters


def samples(metrics: ServerMetrics) -> dict:
    text = metrics.render().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_vllm_names_follow_the_same_counts():
    counters = Counters()
    sched = SimpleNamespace(counters=counters, running=[1, 2], waiting=[3],
                            num_used_tokens=256, kv=SimpleNamespace(pool=SimpleNamespace(size=1024)))
    metrics = ServerMetrics("m")
    counters.retracted_reqs = 3
    metrics.sync(sched)
    counters.retracted_reqs = 5
    metrics.sync(sched)
    m = samples(metrics)
    assert m["engine:num_preemptions_total"] == m["engine:num_retracted_reqs_total"] == 5
    assert m["engine:gpu_cache_usage_perc"] == m["engine:kv_cache_usage_perc"] == 0.25
    assert m["engine:token_usage"] == 0.25 and m["engine:num_running_reqs"] == 2


def test_memory_left_at_start_is_a_gauge_sglangs_name_on_a_gpu():
    metrics = ServerMetrics("m")
    for cuda, gpu_value in ((False, 0.0), (True, 6.5)):
        engine = SimpleNamespace(available_memory=int(6.5 * (1 << 30)),
                                 device=SimpleNamespace(is_cuda=cuda))
        metrics.started(engine)
        m = samples(metrics)
        assert m["engine:startup_available_memory_gb"] == 6.5
        assert m["engine:startup_available_gpu_memory_gb"] == gpu_value
