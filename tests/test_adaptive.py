"""--schedule-conservativeness auto: the ratio learnt from output lengths, against SGLang's 1.0."""

import random

import pytest

from engine import Engine
from engine.config import ConfigError, EngineConfig
from engine.scheduler.adaptive import (MIN_EVIDENCE, MIN_MARGIN, PRIOR, QUIET_S, RETRACT_BUMP,
                                       AdaptiveRatio, make_ratio)
from engine.scheduler.admission import NewTokenRatio
from engine.stats import StepStats


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def workload(n, max_new, early_eos, seed=0):
    """Greedy requests; with ``early_eos`` each stops at the first token of a fixed random set
    of 24 ids (random weights' stand-in for EOS): most stop long before max_new_tokens."""
    rng = random.Random(seed)
    stops = rng.sample(range(3, 500), 24)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(6, 16))] for _ in range(n)]
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new,
              "stop_token_ids": stops if early_eos else []}
    return prompts, params


def serve(model, conservativeness, prompts, params, pool=512):
    """Run every request to the end; the mean token usage over the steps with a queue."""
    engine = Engine(model, device="cpu", max_total_tokens=pool,
                    schedule_conservativeness=conservativeness)
    usage = []
    engine.scheduler.on_step = lambda s: usage.append(s.token_usage) if s.num_queue_reqs else None
    reqs = [engine.add_request(p, params)[0] for p in prompts]
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < 2000
    return {"usage": sum(usage) / len(usage), "steps": steps,
            "retracted": engine.scheduler.counters.retracted_reqs,
            "outputs": [r.output_ids for r in reqs], "ratio": engine.scheduler.ratio}


def test_auto_fills_the_pool_on_early_eos_with_the_same_outputs(model):
    prompts, params = workload(32, 48, early_eos=True)
    fixed, auto = (serve(model, c, prompts, params, pool=384) for c in (1.0, "auto"))
    lengths = [len(o) for o in fixed["outputs"]]
    assert sum(lengths) / len(lengths) < 0.6 * 48  # the workload stops early
    assert auto["outputs"] == fixed["outputs"]  # admission order never changes greedy tokens
    assert auto["usage"] > 1.2 * fixed["usage"], (auto["usage"], fixed["usage"])
    assert auto["steps"] < fixed["steps"]
    assert auto["retracted"] <= 3  # a few while it learns, no storm
    assert auto["ratio"].value < 0.7  # it learnt that requests stop early


def test_auto_on_full_length_requests_behaves_like_1_0(model):
    prompts, params = workload(16, 24, early_eos=False)
    fixed, auto = (serve(model, c, prompts, params, pool=256) for c in (1.0, "auto"))
    assert auto["outputs"] == fixed["outputs"]
    assert all(len(o) == 24 for o in auto["outputs"])
    assert auto["retracted"] <= fixed["retracted"] + 1  # no retraction storm
    assert auto["steps"] <= 1.1 * fixed["steps"]
    assert auto["ratio"].generated_share > 0.8


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def stats(queued, usage, running=4, cap=8, mode="decode"):
    return StepStats(1, mode, running, queued, int(usage * 1000), 1000, max_running_requests=cap)


def finished(length, max_new, reason="stop"):
    from types import SimpleNamespace

    return SimpleNamespace(finish_reason=reason, output_ids=[0] * length,
                           params=SimpleNamespace(max_new_tokens=max_new))


def running(generated, max_new):
    from types import SimpleNamespace

    return SimpleNamespace(output_ids=[0] * generated, remaining_new_tokens=max_new - generated,
                           params=SimpleNamespace(max_new_tokens=max_new))


def test_the_ratio_is_the_observed_share_times_a_margin():
    ratio = AdaptiveRatio(Clock())
    assert ratio.value == pytest.approx(PRIOR)  # starts where conservativeness 1.0 starts
    assert ratio.reserve(running(0, 100)) == pytest.approx(PRIOR * 100)
    for _ in range(500):  # nothing has finished yet: nothing says requests stop early
        ratio.observe(stats(3, 0.5))
    assert ratio.margin == 1.0
    for _ in range(60):
        ratio.finished(finished(10, 100))
    ratio.finished(finished(3, 100, reason="abort"))  # aborted requests say nothing
    assert len(ratio.shares) == 60
    assert ratio.value == pytest.approx((6 + 4 * PRIOR) / 64)
    assert ratio.reserve(running(0, 100)) == pytest.approx(100 * (6 + 4 * PRIOR) / 64)
    # margin falls only while requests wait under 0.9 usage with room in the batch
    before = ratio.margin
    for s in (stats(0, 0.5), stats(3, 0.95), stats(3, 0.5, running=8), stats(3, 0.5,
                                                                              mode="prefill")):
        ratio.observe(s)
    assert ratio.margin == before
    ratio.observe(stats(3, 0.93))
    assert ratio.margin == pytest.approx(before * 0.98)  # near the target: slowly
    ratio.margin = before
    ratio.observe(stats(3, 0.1))
    assert ratio.margin < before * 0.8  # an almost empty pool: fast
    for _ in range(500):
        ratio.observe(stats(3, 0.5))
    assert ratio.margin == MIN_MARGIN


def test_a_request_that_outlived_the_short_ones_is_expected_to_run_like_the_long_ones():
    ratio = AdaptiveRatio(Clock())
    for _ in range(90):
        ratio.finished(finished(5, 100))  # most stop after 5 tokens ...
    for _ in range(10):
        ratio.finished(finished(100, 100, reason="length"))  # ... a few run to the end
    fresh, survivor = ratio.reserve(running(0, 100)), ratio.reserve(running(20, 100))
    assert fresh == pytest.approx((90 * 5 + 10 * 100 + 4 * PRIOR * 100) / 104)
    # past 5 tokens only the long ones (and the prior) are left: 80 more tokens each
    assert survivor == pytest.approx((10 * 80 + 4 * PRIOR * 80) / 14)
    assert survivor > fresh
    assert ratio.reserve(running(100, 100)) == 0
    ratio.margin = 10.0  # a reservation never exceeds what the request may still generate
    assert ratio.reserve(running(20, 100)) == 80


def test_a_retraction_raises_the_margin_and_holds_it_a_minute():
    clock = Clock()
    ratio = AdaptiveRatio(clock)
    for _ in range(MIN_EVIDENCE):
        ratio.finished(finished(10, 100))
    ratio.margin = 0.5
    old, new = ratio.after_retraction([])
    assert ratio.margin == 0.5 * RETRACT_BUMP and new > old
    clock.now = QUIET_S - 1
    ratio.observe(stats(3, 0.5))
    assert ratio.margin == 0.5 * RETRACT_BUMP  # held: at most about one retraction a minute
    clock.now = QUIET_S + 1
    ratio.observe(stats(3, 0.5))
    assert ratio.margin < 0.5 * RETRACT_BUMP
    for _ in range(20):  # bumps stop where new requests reserve all of max_new_tokens
        ratio.after_retraction([])
    assert ratio.value == pytest.approx(1.0)
    assert ratio.margin == pytest.approx(1 / ratio.generated_share)


def test_a_number_keeps_sglangs_schedule_and_bad_values_say_what_to_pass():
    assert isinstance(make_ratio(1.0), NewTokenRatio)
    assert make_ratio(0.3).init == pytest.approx(0.21)
    assert isinstance(make_ratio("auto"), AdaptiveRatio)
    assert EngineConfig(schedule_conservativeness="auto").validate()
    for bad in ("fast", 0, -1.0, "0.3"):
        with pytest.raises(ConfigError, match="--schedule-conservativeness must be a number > 0 "
                                              r"\(1.0: SGLang's default.*or 'auto'"):
            EngineConfig(schedule_conservativeness=bad).validate()


def test_the_cli_takes_auto_and_refuses_a_word():
    from click.testing import CliRunner

    from engine_cli.main import cli

    out = CliRunner().invoke(cli, ["generate", "--schedule-conservativeness", "fast"])
    assert out.exit_code == 2
    assert "'fast' is neither a number nor 'auto'" in out.output
    help_text = CliRunner().invoke(cli, ["serve", "--help"]).output
    assert "--schedule-conservativeness FLOAT|auto" in help_text
