"""`engine tune`: the search on a fake cost function with a known optimum and the guides'
signals (evaluations, budget, rules, SLOs, live vs restart), then for real on a tiny model
(the Evaluator's live changes, refused candidates, the CLI's best command line and its gain)."""

import json
import shlex

import pytest
from click.testing import CliRunner

from engine.bench import Workload
from engine.registry import EngineError
from engine.tune import Evaluator, Knob, Measured, Objective, Trial, grid, run_grid, search
from engine.tune.trial import INFEASIBLE, NOT_APPLICABLE, OK

KNOBS = [
    Knob("schedule_conservativeness", (0.3, 0.5, 0.7, 1.0, 1.3), 1.0, live=True, ordered=True),
    Knob("chunked_prefill_size", (256, None, 1024, 2048, 4096), None, live=True, ordered=True),
    Knob("max_running_requests", (16, 32, 64, 128, None), None, live=True, ordered=True),
    Knob("schedule_policy", ("fcfs", "lpm"), "lpm", live=True, ordered=False),
    Knob("kv_cache_dtype", ("auto", "fp8_e4m3"), "auto", live=False, ordered=False),
]
BEST = {"schedule_conservativeness": 0.5, "chunked_prefill_size": 1024,
        "max_running_requests": 64, "schedule_policy": "fcfs", "kv_cache_dtype": "fp8_e4m3"}


def measured(tput, *, usage=0.95, queue=4.0, retractions=0, ttft=50.0, itl=10.0):
    return Measured(tput, ttft, itl, 0, usage, queue, queue, retractions, 10.0, 100)


class Fake:
    """A known landscape: each knob's distance from BEST costs throughput; conservativeness
    above the optimum shows the guide's "usage < 0.9 with a queue", below it retractions."""

    def __init__(self, clock=None, seconds=1.0, refuse=(), slow=None):
        self.calls, self.clock, self.seconds = [], clock, seconds
        self.refuse, self.slow = refuse, slow or {}

    def __call__(self, config):
        self.calls.append(dict(config))
        if self.clock is not None:
            self.clock.t += self.seconds
        if any(config.get(k) == v for k, v in self.refuse):
            return Trial(config, NOT_APPLICABLE, "backend unusable here")
        tput = 1000.0
        for k in KNOBS:  # a knob not searched stays at its default
            at = k.values.index(config.get(k.name, k.default))
            tput *= 1 - 0.12 * abs(at - k.values.index(BEST[k.name]))
        c = config["schedule_conservativeness"]
        signal = (dict(usage=0.6, queue=8.0) if c > BEST["schedule_conservativeness"] else
                  dict(retractions=40) if c < BEST["schedule_conservativeness"] else {})
        ttft = self.slow.get(tuple(sorted(config.items())), 50.0)
        return Trial(config, OK, measured=measured(tput, ttft=ttft, **signal))


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_search_finds_the_optimum_in_far_fewer_evaluations_than_the_grid():
    fake = Fake()
    full = run_grid(KNOBS, fake)
    assert len(full.trials) == len(grid(KNOBS)) == 5 * 5 * 5 * 2 * 2
    assert full.best.config == BEST
    fake = Fake()
    res = search(KNOBS, fake)
    assert res.best.score >= 0.95 * full.best.score
    assert len(fake.calls) <= len(full.trials) / 5
    assert res.gain == pytest.approx(res.best.score / res.defaults.score)
    assert res.defaults.config == {k.name: k.default for k in KNOBS}
    assert len({tuple(sorted(c.items())) for c in fake.calls}) == len(fake.calls)  # no repeats


def test_grid_varies_restart_knobs_slowest():
    configs = grid(KNOBS)
    changes = sum(a["kv_cache_dtype"] != b["kv_cache_dtype"] for a, b in zip(configs,
                                                                            configs[1:]))
    assert changes == 1


def test_budget_stops_starting_trials_and_reports_what_ran():
    clock = Clock()
    fake = Fake(clock, seconds=10.0)
    res = search(KNOBS, fake, budget_s=35.0, clock=clock)
    assert len(fake.calls) == len(res.trials) == 3  # the 4th would end at 40 s
    assert clock.t <= 35.0
    assert any("budget" in n for n in res.notes)
    assert res.best is not None and res.best.index in (0, 1, 2)


def test_a_trial_that_might_not_fit_is_not_started():
    class Uneven(Fake):  # trials take 10 s, 4 s, 4 s, ...: the mean (6 s) would fit a 4th
        def __call__(self, config):
            self.seconds = 10.0 if not self.calls else 4.0
            return super().__call__(config)

    clock = Clock()
    res = search(KNOBS, Uneven(clock), budget_s=26.0, clock=clock)
    assert len(res.trials) == 3 and clock.t == 18.0  # a 4th could take 10 s: 28 > 26
    assert any("up to 10.0 s each" in n for n in res.notes)


def test_low_usage_with_a_queue_tries_lower_conservativeness_and_prunes_higher():
    fake = Fake()
    search(KNOBS[:1], fake)  # defaults: conservativeness 1.0, above the optimum 0.5
    tried = [c["schedule_conservativeness"] for c in fake.calls]
    assert tried[0] == 1.0 and tried[1] < 1.0
    assert 1.3 not in tried  # the rule pruned "higher"
    assert tried == [1.0, 0.7, 0.5, 0.3]  # walked down while it improved, one step past


def test_frequent_retractions_try_higher_conservativeness_and_prune_lower():
    knob = Knob("schedule_conservativeness", (0.1, 0.2, 0.3, 0.5, 0.7), 0.2, live=True,
                ordered=True)
    def evaluate(config):
        c = config["schedule_conservativeness"]
        calls.append(c)
        signal = dict(retractions=40) if c < 0.5 else dict(usage=0.6, queue=8.0) if c > 0.5 \
            else {}
        tput = 1000 * (1 - 0.1 * abs(knob.values.index(c) - 3))
        return Trial(config, OK, measured=measured(tput, **signal))

    calls = []
    res = search([knob], evaluate)
    assert calls[:2] == [0.2, 0.3] and 0.1 not in calls
    assert res.best.config["schedule_conservativeness"] == 0.5
    assert any("retractions" in n and "higher first" in n for n in res.notes)


def test_slo_infeasible_configs_never_win():
    fastest = tuple(sorted(BEST.items()))
    fake = Fake(slow={fastest: 900.0})  # the fastest config misses a 500 ms p99 TTFT
    res = run_grid(KNOBS, fake, Objective(slo_ttft_ms=500.0))
    missed = [t for t in res.trials if t.config == BEST]
    assert missed[0].status == INFEASIBLE and "p99 TTFT 900.0 ms > 500 ms" in missed[0].reason
    assert res.best.config != BEST and res.best.measured.ttft_p99_ms <= 500.0
    res = search(KNOBS, Fake(slow={fastest: 900.0}), Objective(slo_ttft_ms=500.0))
    assert res.best.config != BEST


def test_refused_candidates_are_skipped_with_the_reason():
    fake = Fake(refuse=[("kv_cache_dtype", "fp8_e4m3")])
    res = search(KNOBS, fake)
    skipped = [t for t in res.trials if t.config["kv_cache_dtype"] == "fp8_e4m3"]
    assert skipped and all(t.status == NOT_APPLICABLE and t.reason == "backend unusable here"
                           and t.score is None for t in skipped)
    assert res.best.config["kv_cache_dtype"] == "auto"


def test_client_bound_defaults_skip_the_admission_knobs():
    def evaluate(config):
        calls.append(config)
        return Trial(config, OK, measured=measured(100.0, usage=0.4, queue=0.0))

    calls = []
    res = search(KNOBS, evaluate)
    assert {k for c in calls[1:] for k, v in c.items() if v != res.defaults.config[k]} == {
        "chunked_prefill_size", "kv_cache_dtype"}
    assert any(n.startswith("client-bound") for n in res.notes)


# -- for real: a tiny model, offline ---------------------------------------------------------
SMALL = Workload(num_prompts=12, random_input_len=24, random_output_len=8,
                 random_range_ratio=0.5)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def test_live_knobs_change_the_running_engine_and_others_restart(model):
    from engine.engine import Engine

    starts = []

    def start(kwargs):
        starts.append(kwargs)
        return Engine(**kwargs)

    ev = Evaluator({"model": model, "max_total_tokens": 400}, SMALL, start=start)
    base = {"schedule_conservativeness": 1.0, "max_running_requests": None,
            "schedule_policy": "lpm", "kv_cache_dtype": "auto"}
    try:
        assert ev(base).how == "restart"
        engine = ev.engine
        t = ev({**base, "max_running_requests": 2, "schedule_conservativeness": 0.3,
                "schedule_policy": "fcfs"})
        assert t.how == "live" and ev.engine is engine and len(starts) == 1
        assert t.status == OK and t.measured.completed == SMALL.num_prompts
        assert engine.scheduler.sizing.max_running_requests == 2
        assert engine.scheduler.ratio.init == pytest.approx(0.7 * 0.3)
        assert type(engine.scheduler.policy).__module__.startswith("engine_policy_fcfs")
        assert ev(base).how == "live" and engine.scheduler.sizing.max_running_requests == 200
        t = ev({**base, "kv_cache_dtype": "fp8_e4m3"})
        assert t.how == "restart" and len(starts) == 2 and ev.engine is not engine
        assert starts[1]["kv_cache_dtype"] == "fp8_e4m3"
    finally:
        ev.close()


def test_a_live_batch_cap_binds_like_a_restarted_one(model):
    from engine.bench import run_bench
    from engine.tune.live import set_live

    ev = Evaluator({"model": model, "max_total_tokens": 400}, SMALL)
    try:
        ev({"max_running_requests": None})
        set_live(ev.engine, "max_running_requests", 3)
        result = run_bench(ev.engine, SMALL)
        assert max(s.num_running_reqs for s in result.timeline) == 3
    finally:
        ev.close()


def test_max_running_requests_restarts_when_the_pool_depends_on_it(model):
    from engine.tune.live import live_problem

    ev = Evaluator({"model": model, "mem_fraction_static": 0.01}, SMALL)
    try:
        ev({"max_running_requests": 8})
        assert "--max-total-tokens" in live_problem(ev.engine, "max_running_requests", 4)
        assert ev({"max_running_requests": 4}).how == "restart"
    finally:
        ev.close()


def test_an_unusable_backend_is_not_applicable_here_and_the_search_goes_on(model):
    ev = Evaluator({"model": model, "max_total_tokens": 400, "device": "cpu"}, SMALL)
    knob = Knob("attention_backend", ("auto", "fa3"), "auto", live=False, ordered=False)
    try:
        res = search([knob], ev)
    finally:
        ev.close()
    fa3 = res.trials[1]
    assert fa3.status == NOT_APPLICABLE and "fa3" in fa3.reason and "unusable" in fa3.reason
    assert res.best.config == {"attention_backend": "auto"}


def test_cli_prints_a_best_command_that_serve_accepts_with_a_measured_gain(model):
    from engine_cli.main import cli
    from engine_cli.serve_cmd import serve_command

    args = ["tune", "--num-prompts", "12", "--random-input-len", "24", "--random-output-len",
            "8", "--random-range-ratio", "0.5", "--knobs",
            "schedule-conservativeness,kv-cache-dtype", "--values",
            "schedule-conservativeness=0.3", "--values", "kv_cache_dtype=fp8_e4m3", "--json",
            "--", "--model", model, "--max-total-tokens", "400"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    trials = d["trials"]
    assert 2 <= len(trials) <= 4 and trials[0]["config"] == {
        "schedule_conservativeness": 1.0, "kv_cache_dtype": "auto"}
    best = max((t for t in trials if t["score"] is not None), key=lambda t: t["score"])
    assert d["best"] == best
    base = trials[0]["measured"]["output_throughput"]
    assert d["gain"] == pytest.approx(best["measured"]["output_throughput"] / base)
    assert d["live"] + d["restarts"] == len(trials) and d["restarts"] >= 1
    words = shlex.split(d["command"])
    assert words[:2] == ["engine", "serve"]
    ctx = serve_command.make_context("serve", words[2:])
    assert ctx.params["model"] == model and ctx.params["max_total_tokens"] == 400
    assert ctx.params["schedule_conservativeness"] == best["config"][
        "schedule_conservativeness"]
    assert ctx.params["kv_cache_dtype"] == best["config"]["kv_cache_dtype"]
    assert "trial  0  restart" in r.stderr  # each trial printed as it finished


def test_cli_refuses_bad_knobs_and_values(model):
    from engine_cli.main import cli

    def run(*extra):
        return CliRunner().invoke(cli, ["tune", *extra, "--", "--model", model])

    r = run("--knobs", "warp-speed")
    assert r.exit_code == 2 and "warp-speed: not a knob" in r.output
    r = run("--values", "schedule-conservativeness=fast")
    assert r.exit_code == 2 and "'fast' is not a value" in r.output
    r = run("--knobs", "chunked-prefill-size", "--values", "schedule-policy=fcfs")
    assert r.exit_code == 2 and "which --knobs does not search" in r.output
    for fixed in ("--max-running-requests", "--max-num-seqs"):  # vLLM's spelling fixes it too
        r = CliRunner().invoke(cli, ["tune", "--knobs", "max-running-requests", "--", fixed,
                                     "8"])
        assert r.exit_code == 2 and "both searched (--knobs) and fixed" in r.output
    r = run("--gsp-num-groups", "3")
    assert r.exit_code == 2 and "does not read it" in r.output


def test_the_defaults_that_cannot_run_are_an_error():
    with pytest.raises(EngineError, match="the defaults cannot run: backend unusable"):
        search(KNOBS, Fake(refuse=[("kv_cache_dtype", "auto")]))
