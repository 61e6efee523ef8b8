"""Each symptom of the tuning guide, driven with a tiny model: the advice is logged once, listed
in the engine's published info (/get_server_info) and printed by `engine doctor`; a healthy run
gets none."""

import json
import logging
import random

import httpx
import pytest
from click.testing import CliRunner

import engine_advisor
from engine import Engine
from engine.advice import SYMPTOMS, Sample, Settings, diagnose
from engine.plugins import load_plugins
from engine_cli.main import cli

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(autouse=True)
def advisor():
    """The plugin, registered as an installed one would be (once)."""
    pm = load_plugins()
    if pm.is_registered(engine_advisor):
        yield
        return
    pm.register(engine_advisor, name="advisor-under-test")
    try:
        yield
    finally:
        pm.unregister(name="advisor-under-test")


def ids(seed, n, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run(engine, prompts, params, caplog, before_step=None):
    """Queue every prompt, step to the end; the advisor's log lines and published symptoms."""
    with caplog.at_level(logging.INFO, logger="engine.advisor"):
        for p in prompts:
            engine.add_request(p, params)
        steps = 0
        while engine.scheduler.has_work:
            engine.step()
            steps += 1
            assert steps < 3000
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.advisor"]
    return lines, [a["symptom"] for a in engine.scheduler.extra_info["advice"]]


def logged_once(lines, text):
    return sum(1 for line in lines if text in line) == 1


def test_plugin_is_installed():
    data = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).output)
    assert "engine-advisor" in {p["dist"] for p in data["plugins"]}


def test_a_healthy_run_gets_no_advice(model, caplog):
    """The batch is full and requests wait: nothing to tune."""
    engine = Engine(model, device="cpu", max_total_tokens=1024, max_running_requests=8)
    lines, symptoms = run(engine, [ids(i, 8) for i in range(40)],
                          {**GREEDY, "max_new_tokens": 24}, caplog)
    assert lines == [] and symptoms == []


def test_one_request_at_a_time_gets_queue_empty_and_small_batch(model, caplog):
    engine = Engine(model, device="cpu", max_total_tokens=1024, max_running_requests=64)
    lines, symptoms = run(engine, [ids(1, 8), ids(2, 8)], {**GREEDY, "max_new_tokens": 80},
                          caplog)
    assert symptoms == ["queue_empty", "small_decode_batch"]
    assert logged_once(lines, "#queue-req was 0 in 100% of the last")
    assert logged_once(lines, "submitting requests too slowly. A healthy range for #queue-req "
                              "is 100 - 2000")
    assert logged_once(lines, "the decode batch (#running-req 2.0 on average over")
    assert logged_once(lines, "much smaller than --max-running-requests 64")


def test_a_too_conservative_server_is_told_to_lower_the_flag(model, caplog):
    """Conservativeness 10 reserves every max_new_tokens while requests stop early."""
    rng = random.Random(0)
    stops = rng.sample(range(3, 500), 24)
    engine = Engine(model, device="cpu", max_total_tokens=512, schedule_conservativeness=10)
    lines, symptoms = run(engine, [ids(i, 8) for i in range(24)],
                          {**GREEDY, "max_new_tokens": 64, "stop_token_ids": stops}, caplog)
    assert "low_token_usage" in symptoms
    assert logged_once(lines, "token usage < 0.9 with #queue-req > 0 in")
    assert logged_once(lines, "--schedule-conservativeness 10): the server is too conservative "
                              "about taking in new requests. Decrease "
                              "--schedule-conservativeness to a value like 0.3")


def test_frequent_retractions_are_told_to_raise_the_flag(model, caplog):
    engine = Engine(model, device="cpu", max_total_tokens=160, schedule_conservativeness=0.1)
    lines, symptoms = run(engine, [ids(i, 20 + i) for i in range(8)],
                          {**GREEDY, "max_new_tokens": 40}, caplog)
    assert "frequent_retractions" in symptoms
    assert logged_once(lines, "increase --schedule-conservativeness (now 0.1) to a value like "
                              "1.3")


def test_a_queue_above_2000_is_too_long(model, caplog):
    engine = Engine(model, device="cpu", max_total_tokens=256, max_running_requests=4,
                    schedule_policy="fcfs")
    lines, symptoms = [], []
    with caplog.at_level(logging.INFO, logger="engine.advisor"):
        for i in range(2040):
            engine.add_request([3 + i % 400, 4], {**GREEDY, "max_new_tokens": 2})
        for _ in range(40):
            engine.step()
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.advisor"]
    symptoms = [a["symptom"] for a in engine.scheduler.extra_info["advice"]]
    assert "long_queue" in symptoms
    assert logged_once(lines, "#queue-req was above 2000 in")


def out_of_memory_in_prefill(engine):
    """The runner's next forward with prompt tokens raises CUDA's out-of-memory error."""
    import torch

    forward = engine.runner.forward

    def failing(batch):
        if any(n > 1 for n in batch.extend_lens) and not failing.done:
            failing.done = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(batch)

    failing.done = False
    engine.runner.forward = failing


def test_prefill_oom_in_a_server_shows_at_server_info_and_in_engine_doctor(model, caplog):
    from engine_testing.servers import InProcessServer

    engine = Engine(model, device="cpu", max_total_tokens=512, chunked_prefill_size=64)
    out_of_memory_in_prefill(engine)
    with caplog.at_level(logging.INFO, logger="engine.advisor"), InProcessServer(engine) as s:
        body = {"input_ids": ids(0, 12), "sampling_params": {**GREEDY, "max_new_tokens": 2}}
        assert httpx.post(s.url + "/generate", json=body, timeout=60).status_code >= 500
        assert httpx.post(s.url + "/generate", json=body, timeout=60).status_code == 200
        info = httpx.get(s.url + "/get_server_info", timeout=30).json()
        doctor = CliRunner().invoke(cli, ["doctor", "--url", s.url, "--duration", "0.5",
                                          "--interval", "0.1"])
    assert info["prefill_oom_errors"] == 1
    [advice] = [a for a in info["advice"] if a["symptom"] == "prefill_oom"]
    assert advice["message"] == (
        "out of memory during prefill happened 1 time(s) (--chunked-prefill-size 64): try "
        "reducing --chunked-prefill-size to 4096 or 2048.")
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.advisor"]
    assert lines.count(f"advisor: {advice['message']}") == 1
    assert doctor.exit_code == 0, doctor.output
    assert f"[prefill_oom] (the server's advisor, step {advice['step']}) " \
           f"{advice['message']}" in doctor.output


def test_engine_doctor_runs_the_rules_on_what_it_polls(model, monkeypatch):
    """Without the server's advisor, doctor's own polls find the symptom (the same rules)."""
    import engine_cli.doctor_cmd as doctor

    polls = iter([Sample(t, 1, 0, 0.1, 0) for t in range(40)])
    info = {"max_running_requests": 64, "served_model_name": "m"}
    monkeypatch.setattr(doctor, "sample", lambda url, key: (next(polls), info))
    monkeypatch.setattr(doctor, "sleep", lambda s: None)
    ticks = iter(range(10_000))
    monkeypatch.setattr(doctor, "monotonic", lambda: next(ticks) * 0.01)
    out = CliRunner().invoke(cli, ["doctor", "--url", "http://x", "--duration", "0.35",
                                   "--interval", "0.01"])
    assert out.exit_code == 0, out.output
    assert "the server runs no advisor" in out.output
    assert "[queue_empty] (seen now) #queue-req was 0 in 100% of the last" in out.output
    assert "[small_decode_batch] (seen now)" in out.output


def test_engine_doctor_says_what_is_wrong_with_the_url():
    out = CliRunner().invoke(cli, ["doctor", "--url", "http://127.0.0.1:9", "--duration", "0"])
    assert out.exit_code == 1
    assert "cannot reach http://127.0.0.1:9/metrics" in out.output
    assert "is `engine serve` running there?" in out.output


def test_every_rule_is_quiet_on_a_busy_healthy_window():
    samples = [Sample(t, 8, 300, 0.95, 0) for t in range(64)]
    assert diagnose(samples, Settings(max_running_requests=8)) == []
    assert len(SYMPTOMS) == 6


def test_an_engine_started_before_the_plugin_is_judged_from_then_on():
    """Its counts so far (10 retractions) are not taken for a burst in the first window."""
    from engine.stats import Counters, StepStats

    from engine_advisor.advisor import observe

    info, totals = {}, Counters(retracted_reqs=10)
    for step in range(64):
        observe(StepStats(step, "decode", 8, 300, 950, 1000, totals=totals,
                          max_running_requests=8, extra_info=info))
    assert info["advice"] == []
    totals.retracted_reqs += 4  # a burst now is one
    observe(StepStats(64, "decode", 8, 300, 950, 1000, totals=totals, max_running_requests=8,
                      extra_info=info))
    assert [a["symptom"] for a in info["advice"]] == ["frequent_retractions"]


def test_the_memory_left_at_start_is_logged_and_judged(model, caplog, monkeypatch):
    """SGLang's memory lines come before the server is ready; the guide's 5-8 GB rule on what a
    GPU has left (a CPU's RAM is the system's: no advice there)."""
    from types import SimpleNamespace

    from engine.advice import memory_at_start
    from engine_advisor import advisor as adv

    caplog.set_level(logging.INFO, logger="engine")
    engine = Engine(model, max_total_tokens=500)
    text = caplog.text
    for words in ("Load weight end. type=LlamaForCausalLM, dtype=torch.float32, avail mem=",
                  "KV Cache is allocated. #tokens: 500, K size: ", "Memory pool end. avail mem=",
                  "memory at start: available_mem="):
        assert words in text
    assert engine.available_memory > 0
    assert not [a for a in engine.scheduler.extra_info["advice"]
                if a["symptom"] == "memory_at_start"]  # a CPU: no advice
    gb = 1 << 30
    assert memory_at_start(6 * gb, True, 0.88) is None
    low = memory_at_start(2 * gb, True, 0.88)
    assert "Decrease --mem-fraction-static (now 0.88)" in low.message
    assert "Increase --mem-fraction-static" in memory_at_start(20 * gb, True, 0.7).message
    assert memory_at_start(2 * gb, False, 0.88) is None
    # on a GPU with little left, the advisor says so at start
    fake = SimpleNamespace(sizing=engine.sizing, config=engine.config, available_memory=2 * gb,
                           device=SimpleNamespace(is_cuda=True),
                           scheduler=SimpleNamespace(extra_info={}))
    adv.start(fake)
    assert fake.scheduler.extra_info["advice"][0]["symptom"] == "memory_at_start"
