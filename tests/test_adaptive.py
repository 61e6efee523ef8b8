"""--schedule-conservativeness auto: the ratio learnt from output lengths, against SGLang's 1.0."""

import math
import random

import pytest

from engine import Engine
from engine.config import ConfigError, EngineConfig
import numpy as np

from engine.scheduler.adaptive import (COST_STEPS, EARLY_HALF, EARLY_RISK, FLOOR_BUDGET, MODEL_RISK,
                                       PRICE_MAX, Z_DEAR, Z_MIN, AdaptiveRatio, FloorPlan, PeakPlan,
                                       Rows, SurvivalCurve, make_ratio)
from engine.scheduler.admission import NewTokenRatio


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


NEVER = 10 ** 6  # a stop id beyond the vocabulary: never produced, but a possible stop


def workload(n, max_new, early_eos, seed=0, known=False):
    """Greedy requests; with ``early_eos`` each stops at the first token of a fixed random set
    of 24 ids (random weights' stand-in for EOS): most stop long before max_new_tokens;
    ``early_eos="shift"``: the first half do, the second half run to max_new_tokens. The
    full-length ones carry a stop id never produced (NEVER), so their length is unknown to
    the scheduler, as a natural long answer's; ``known``: plain ignore_eos (runs_to_max)."""
    rng = random.Random(seed)
    stops = rng.sample(range(3, 500), 24)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(6, 16))] for _ in range(n)]
    early = {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new,
             "stop_token_ids": stops}
    full = {**early, "stop_token_ids": [] if known else [NEVER]}
    if early_eos == "shift":
        return prompts, [early if i < n // 2 else full for i in range(n)]
    return prompts, early if early_eos else full


def drain(engine, limit: int) -> int:
    """Step until nothing is left, checking the slot invariant after every step; the steps."""
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < limit
    return steps


def serve(model, conservativeness, prompts, params, pool=512, **options):
    """Run every request to the end; the mean token usage over the steps with a queue."""
    engine = Engine(model, device="cpu", max_total_tokens=pool,
                    schedule_conservativeness=conservativeness, **options)
    usage = []
    engine.scheduler.on_step = lambda s: usage.append(s.token_usage) if s.num_queue_reqs else None
    each = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [engine.add_request(p, q)[0] for p, q in zip(prompts, each)]
    steps = drain(engine, 2000)
    return {"usage": sum(usage) / len(usage), "steps": steps,
            "retracted": engine.scheduler.counters.retracted_reqs,
            "outputs": [r.output_ids for r in reqs], "ratio": engine.scheduler.ratio}


def test_auto_fills_the_pool_on_early_eos_with_the_same_outputs(model):
    prompts, params = workload(32, 48, early_eos=True)
    fixed, auto = (serve(model, c, prompts, params, pool=384) for c in (1.0, "auto"))
    lengths = [len(o) for o in fixed["outputs"]]
    assert sum(lengths) / len(lengths) < 0.6 * 48  # the workload stops early
    assert auto["outputs"] == fixed["outputs"]  # admission order never changes greedy tokens
    assert auto["usage"] > fixed["usage"], (auto["usage"], fixed["usage"])
    assert auto["steps"] < fixed["steps"], (auto["steps"], fixed["steps"])
    assert auto["retracted"] <= 3  # a few while it learns, no storm
    assert auto["ratio"].value < 0.5  # it learnt that requests stop early


def test_auto_on_full_length_requests_behaves_like_1_0(model):
    prompts, params = workload(16, 24, early_eos=False)
    fixed, auto = (serve(model, c, prompts, params, pool=256) for c in (1.0, "auto"))
    assert auto["outputs"] == fixed["outputs"]
    assert all(len(o) == 24 for o in auto["outputs"])
    # 1.0 admits past the pool and retracts; auto plans for the peak (every request runs to
    # the end: nothing to gamble on), so it retracts less and takes more, smaller steps
    assert auto["retracted"] <= fixed["retracted"], (auto["retracted"], fixed["retracted"])
    assert auto["steps"] <= 1.35 * fixed["steps"], (auto["steps"], fixed["steps"])
    assert auto["ratio"].value > 0.8  # it learnt that requests run to the end


def test_requests_certain_to_run_to_max_new_tokens_are_planned_at_their_length(model):
    """ignore_eos without stop ids, stop strings or a grammar (what bench_serving and `engine
    bench` send): auto counts each at its exact length (no retraction where 1.0 retracts) and
    learns nothing about other requests' lengths from them."""
    prompts, params = workload(16, 24, early_eos=False, known=True)
    fixed, auto = (serve(model, c, prompts, params, pool=256) for c in (1.0, "auto"))
    assert auto["outputs"] == fixed["outputs"]
    assert fixed["retracted"] > 0 and auto["retracted"] == 0, \
        (fixed["retracted"], auto["retracted"])
    assert auto["steps"] <= 1.15 * fixed["steps"], (auto["steps"], fixed["steps"])  # 60 vs 55
    ratio = auto["ratio"]
    assert ratio.finished_count == 16 and ratio.observed == 0 and not ratio.done_share


def test_what_makes_a_request_certain_to_run_to_max_new_tokens():
    from engine.scheduler.peak_plan import runs_to_max

    assert runs_to_max(req(0, 100, ignore_eos=True))
    assert not runs_to_max(req(0, 100))  # EOS can end it
    for field, value in (("stop_token_ids", [5]), ("stop", ["x"]), ("regex", "a+")):
        r = req(0, 100, ignore_eos=True)
        setattr(r.params, field, value)
        assert not runs_to_max(r), field
    r = req(0, 100, ignore_eos=True)
    r.grammar = object()  # a grammar ends it when it completes
    assert not runs_to_max(r)


def test_a_grammar_ends_a_request_that_ignores_eos_and_auto_does_not_count_on_its_length(model):
    """A request that ignores EOS under a grammar is not of known length (the grammar ends it):
    beside requests of known length in a tight pool, auto gives every request 1.0's tokens, the
    grammar's request stops where its grammar completes, and only it taught the curve."""
    from engine.interfaces import Constraint
    from engine.scheduler.peak_plan import runs_to_max

    prompts, params = workload(12, 24, early_eos=False, known=True)
    regex = Constraint("regex", "(ab|cd)+x", "regex")

    def outputs(conservativeness):
        engine = Engine(model, device="cpu", max_total_tokens=200,
                        schedule_conservativeness=conservativeness)
        reqs = [engine.add_request(p, {**params, "temperature": 0.9, "seed": i},
                                   **({"constraint": regex} if i % 4 == 0 else {}))[0]
                for i, p in enumerate(prompts)]
        assert [runs_to_max(r) for r in reqs] == [i % 4 != 0 for i in range(len(reqs))]
        drain(engine, 2000)
        return reqs, engine.scheduler

    (auto, scheduler), (fixed, _) = outputs("auto"), outputs(1.0)
    assert [r.output_ids for r in auto] == [r.output_ids for r in fixed]
    grammar = [r for r in auto if r.grammar is not None]
    assert all(r.finish_reason == "stop" and len(r.output_ids) < 24 for r in grammar)
    assert all(len(r.output_ids) == 24 for r in auto if r.grammar is None)
    assert scheduler.ratio.observed == len(grammar) == len(scheduler.ratio.done_share)


def test_a_certain_request_is_held_at_its_length():
    """A running request certain to run to max_new_tokens holds exactly its remaining tokens at
    the peak (no z, no model risk: the worst case), and a certain candidate raises the peak by
    exactly what it holds then."""
    ratio = timed_ratio(GPU)
    for i in range(40):  # a curve of short answers: a natural request is counted short
        ratio.finished(req(5, 100, arrival=i, reason="stop"))
    certain = req(20, 100, prompt=30, arrival=40, ignore_eos=True)
    rows = Rows.of([certain])
    assert rows.certain.tolist() == [True]
    plan = PeakPlan(ratio.curve(rows), rows, 0.0, z=4.0, risk=1.0)
    assert plan.peak == pytest.approx(80, abs=100 / 31)  # 80 more tokens, then it ends
    natural = PeakPlan(ratio.curve(rows), rows, 0.0, z=0.5, risk=0.0)
    assert natural.peak == pytest.approx(plan.peak)  # nothing to be unsure of
    # both grow for 80 steps (the peak: 80 + 10 + 80), then the running one gives back its 130
    assert plan.reservation(req(0, 100, prompt=10, arrival=41, ignore_eos=True), 10) \
        == pytest.approx(80, abs=100 / 31)
    # a natural candidate: the curve's (short) without model risk, the worst case with it
    assert natural.reservation(req(0, 100, prompt=10, arrival=41), 10) < 40
    assert plan.reservation(req(0, 100, prompt=10, arrival=41), 10) == pytest.approx(80, abs=4)


def test_a_certain_request_refused_by_pacing_is_tried_again_once_its_bin_clears():
    """Known lengths are paced from the first step; a refusal stands only until the refused
    request's finish would fall in the next bin (then the plan is made again), at most
    PLAN_EVERY steps."""
    from engine.scheduler.adaptive import PLAN_EVERY, REFUSAL

    ratio = AdaptiveRatio()
    ratio.steps = 5
    running = [req(0, 64, prompt=10, arrival=0, ignore_eos=True)]
    plan = ratio.plan(running, capacity=1024)
    second = req(0, 64, prompt=10, arrival=1, ignore_eos=True)
    assert plan.reservation(second, 10) == float("inf")  # it would finish with the first
    spacing = plan.spacing(Rows.of([second], candidate_extend=10))
    # its known length, over the pool less that length (the pool's peak, not its mean)
    assert spacing == pytest.approx((10 * 64 + 64 * 64 / 2) / (1024 - 64))
    assert 0 < plan.paced <= spacing
    stands = min(math.ceil(plan.paced), PLAN_EVERY)
    later = [ratio.plan(running, capacity=1024) for _ in range(stands)]
    assert later[:stands - 1] == [REFUSAL] * (stands - 1) and later[-1] is not REFUSAL
    natural = AdaptiveRatio()  # no curve yet: a request of unknown length is not paced
    assert natural.plan([req(0, 64, prompt=10)], capacity=1024).reservation(
        req(0, 64, prompt=10, arrival=1), 10) < 1024


def test_a_workload_that_turns_long_halfway_costs_few_retractions(model):
    prompts, params = workload(48, 32, early_eos="shift")
    fixed, auto = (serve(model, c, prompts, params, pool=320) for c in (1.0, "auto"))
    assert auto["outputs"] == fixed["outputs"]
    lengths = [len(o) for o in auto["outputs"]]
    assert sum(lengths[:24]) < 0.6 * 24 * 32 and all(n == 32 for n in lengths[24:])
    assert auto["retracted"] <= max(fixed["retracted"], 3), (auto["retracted"], fixed["retracted"])
    assert auto["steps"] <= 1.1 * fixed["steps"], (auto["steps"], fixed["steps"])


@pytest.mark.parametrize("options", [{"enable_overlap_schedule": True},
                                     {"chunked_prefill_size": 16},
                                     {"speculative_algorithm": "NGRAM"}],
                         ids=["overlap", "chunked", "ngram"])
@pytest.mark.parametrize("known", [False, True], ids=["natural", "known-lengths"])
def test_auto_and_its_floor_in_every_scheduler_mode(model, options, known):
    """The floored plan admits through the same scheduler paths in every mode, for requests of
    unknown and of known length: the same greedy outputs as 1.0, the slot invariant after
    every step (serve checks it)."""
    prompts, params = workload(32, 32, early_eos="shift", known=known)
    fixed, auto = (serve(model, c, prompts, params, pool=288, **options) for c in (1.0, "auto"))
    assert auto["outputs"] == fixed["outputs"]
    assert fixed["usage"] > 0.5 and auto["usage"] > 0.5  # requests waited for a full pool


@pytest.mark.parametrize("overlap", [False, True])
def test_auto_with_every_request_kind_in_a_tight_pool(model, overlap):
    """Greedy, seeded sampling, n > 1, a streamed request and prompt scoring (echo +
    logprobs) together, in a pool that makes admission matter: auto gives each request what
    1.0 gives it (admission order never changes a request's tokens; its prompt scores move
    only by float rounding, as the batches around it differ)."""
    rng = random.Random(7)
    jobs = []
    for i in range(24):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(6, 20))]
        kind = i % 4
        params = {"max_new_tokens": rng.randint(8, 40), "ignore_eos": True,
                  "temperature": 0 if kind == 0 else 0.8, "seed": i,
                  **({"n": 2} if kind == 2 else {})}
        jobs.append((prompt, params, 3 if kind == 3 else None, kind == 1))

    def outputs(conservativeness):
        engine = Engine(model, device="cpu", max_total_tokens=160, enable_overlap_schedule=overlap,
                        schedule_conservativeness=conservativeness)
        reqs = [r for prompt, params, top, stream in jobs
                for r in engine.add_request(prompt, params, stream=stream, prompt_logprobs=top)]
        drain(engine, 3000)
        assert all(r.finished for r in reqs)
        return reqs

    auto, fixed = outputs("auto"), outputs(1.0)
    assert [r.output_ids for r in auto] == [r.output_ids for r in fixed]
    for a, f in zip(auto, fixed):  # scores within float rounding of another batch's shape
        assert len(a.input_logprobs) == len(f.input_logprobs)
        assert a.input_logprobs[1:] == pytest.approx(f.input_logprobs[1:], abs=1e-4)


def req(generated, max_new, prompt=10, arrival=0, cached=0, reason=None, ignore_eos=False):
    """A stand-in request: ``generated`` output tokens of ``max_new``."""
    from types import SimpleNamespace

    from engine.sampling.params import SamplingParams

    out = [0] * generated
    return SimpleNamespace(output_ids=out, prompt_ids=[0] * prompt, arrival=arrival,
                           cached_tokens=cached, finish_reason=reason, grammar=None,
                           seq_len=prompt + generated, alloc_len=prompt + generated,
                           remaining_new_tokens=max_new - generated,
                           params=SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos))


def test_kaplan_meier_with_censoring_on_known_numbers():
    # events at 0.1, 0.3, 0.5; censored (still running) at 0.2 and 0.4
    curve = SurvivalCurve([0.1, 0.2, 0.3, 0.4, 0.5], [1, 0, 1, 0, 1], [1.0] * 5)
    at = lambda x: float(curve(np.array([x]))[0])  # noqa: E731
    assert at(0.05) == 1.0
    assert at(0.1) == pytest.approx(4 / 5)  # 5 at risk, 1 stops
    assert at(0.25) == pytest.approx(4 / 5)  # a censored one is no event
    assert at(0.3) == pytest.approx(4 / 5 * 2 / 3)  # 3 at risk (0.2 left the risk set)
    assert at(0.5) == 0.0  # the last one at risk stops
    # a tie: events first, the censored one at 0.3 was still at risk there
    tie = SurvivalCurve([0.3, 0.3, 0.6], [1, 0, 1], [1.0] * 3)
    assert float(tie(np.array([0.3]))[0]) == pytest.approx(2 / 3)
    # weights count as that many requests
    heavy = SurvivalCurve([0.1, 0.9], [1, 0], [3.0, 1.0])
    assert float(heavy(np.array([0.5]))[0]) == pytest.approx(1 / 4)
    # expected share added by one alive at p: the integral of S(x)/S(p) over [p, 1]
    flat = SurvivalCurve([0.5, 1.0], [1, 0], [1.0, 1.0])  # S = 1 up to 0.5, then 1/2
    assert flat.expected_share(0.0) == pytest.approx(0.75, abs=0.01)
    assert flat.expected_share(0.6) == pytest.approx(0.4, abs=0.01)


def test_short_requests_finishing_first_do_not_fool_the_estimate_for_the_long_ones():
    """Survivorship: 40 short requests (5 of 100 tokens) have finished, 40 long ones run at 20.
    Finished requests alone say "everything stops at 5%"; with the running ones as censored
    observations, one alive at 20% is expected to run to the end."""
    ratio = AdaptiveRatio()
    for i in range(40):
        ratio.finished(req(5, 100, arrival=i, reason="stop"))
    long_ones = [req(20, 100, arrival=40 + i) for i in range(40)]
    curve = ratio.curve(Rows.of(long_ones))
    assert curve.expected_share(0.2) == pytest.approx(0.8, abs=0.01)  # all of what is left
    assert curve.expected_share(0.0) > 0.4  # a fresh one: half of them were long
    finished_only = ratio.curve()
    assert finished_only.expected_share(0.0) < 0.1  # what the biased estimate would say
    # and the plan counts the running long ones for all of their remaining tokens
    plan = ratio.peak_plan(long_ones)
    assert plan.held >= 40 * 80


def expected_usage(curve, reqs, extends, horizon):
    """E[slots held t steps on] for every integer t, by brute force (no grid): running ``reqs``
    hold their sequence and grow one a step while alive; ``extends`` are candidates' prompts."""
    out = []
    for t in range(horizon + 1):
        total = 0.0
        for r, extend in zip(reqs, extends):
            m, g = r.params.max_new_tokens, len(r.output_ids)
            s_now = float(curve(np.array([g / m]))[0]) or 1.0
            q = float(curve(np.array([(g + t) / m]))[0]) / s_now if t < m - g else 0.0
            total += q * ((extend if extend is not None else r.seq_len) + t)
        out.append(total)
    return out


def admit_in_order(plan, available, candidates) -> list:
    """The scheduler's arithmetic (_try_admit / StepPrefill.add_new): ``candidates`` in order,
    each with its whole prompt to prefill, until one does not fit; the ones admitted."""
    reserve, admitted = plan.held, []
    for cand in candidates:
        extend = cand.seq_len
        reservation = plan.reservation(cand, extend)
        if extend + reservation > available - reserve:
            break
        available -= extend
        reserve += reservation
        plan.admitted(cand, extend)
        admitted.append(cand)
    return admitted


@pytest.mark.parametrize("seed", range(5))
def test_peak_admission_never_admits_past_the_pool_in_expectation(seed):
    rng = random.Random(seed)
    ratio = AdaptiveRatio()
    for i in range(60):
        ratio.finished(req(min(int(rng.expovariate(1 / 40)) + 1, 200), 200, arrival=i,
                           reason="stop"))
    running = [req(rng.randrange(0, 150), 200, prompt=rng.randrange(5, 40), arrival=60 + i)
               for i in range(rng.randrange(5, 30))]
    pool = 4000
    plan = ratio.peak_plan(running)
    admitted = admit_in_order(plan, pool - sum(r.seq_len for r in running),
                              (req(0, 200, prompt=rng.randrange(5, 40), arrival=100 + i)
                               for i in range(200)))
    assert admitted  # there was room
    curve = ratio.last_curve
    usage = expected_usage(curve, running + admitted,
                           [None] * len(running) + [c.seq_len for c in admitted], 200)
    assert max(usage) <= pool, (max(usage), pool)
    # and the plan itself is what was checked: its peak (with z and the model risk) fits
    assert plan.committed <= pool - sum(r.seq_len for r in running) + 1e-6


def test_the_peak_never_reserves_more_than_every_request_running_to_its_max():
    """z·σ and the model risk bound an uncertainty that ends at max_new_tokens: with a curve
    that cannot tell short from long (half the finished at 5%, half at 100%) and the largest z
    and risk, E + z·σ passes the worst case, and the peak stops there."""
    ratio = AdaptiveRatio()
    for i in range(40):
        ratio.finished(req(10 if i % 2 else 200, 200, arrival=i, reason="stop"))
    running = [req(g, 200, prompt=30, arrival=40 + i) for i, g in enumerate((5, 40, 80, 120))]
    rows = Rows.of(running)
    plan = PeakPlan(ratio.curve(rows), rows, 0.0, z=4.0, risk=1.0)
    safe = plan.mean + plan.z * np.sqrt(plan.var)
    assert safe.max() > plan.worst.max()  # the cap is what holds the peak down here
    assert plan.peak == pytest.approx(max(np.minimum(safe, plan.worst).max(), 0.0))
    # the worst case by brute force: alive until max_new_tokens, then its slots given back
    width = plan.horizon / (len(plan.t) - 1)
    brute = max(sum(t if t < 200 - len(r.output_ids) else -r.seq_len for r in running)
                for t in range(201))
    assert brute <= plan.worst.max() <= brute + len(running) * width
    # a candidate raises the peak by at most its own worst case (prompt + max_new_tokens)
    cand = req(0, 200, prompt=30, arrival=50)
    assert plan.reservation(cand, 30) <= 200 + 1e-6


def early(finished: int) -> float:
    """The risk a ratio holds after ``finished`` requests and nothing else: MODEL_RISK plus the
    early risk, halved every EARLY_HALF of them."""
    return MODEL_RISK + EARLY_RISK * 0.5 ** (finished / EARLY_HALF)


def test_a_retraction_raises_the_risk_by_its_cost_and_finishes_bring_it_down():
    ratio = AdaptiveRatio()
    for i in range(20):
        ratio.finished(req(10, 100, arrival=i, reason="stop"))
    running = [req(50, 100, prompt=50) for _ in range(4)]  # 100 tokens each
    base = ratio.risk
    assert base == pytest.approx(early(20))
    old, new = ratio.after_retraction(running, [req(50, 100, prompt=50)])
    assert old == base and new > base
    small_old, small_new = AdaptiveRatio().after_retraction(running, [req(0, 100, prompt=10)])
    assert small_new - small_old < new - old  # a cheaper victim costs less risk
    for i in range(100):  # requests finishing without a retraction: evidence, not seconds
        ratio.finished(req(10, 100, arrival=20 + i, reason="stop"))
    assert ratio.risk == pytest.approx(early(120), abs=0.01)


def test_before_evidence_auto_holds_back_as_sglangs_schedule_starts():
    """With nothing finished yet a new request is reserved MODEL_RISK + EARLY_RISK (0.9) of
    the gap to running to max_new_tokens, about SGLang's starting 0.7 x conservativeness;
    the early share halves every EARLY_HALF finished requests (evidence, not steps), so a
    workload that changes after a few dozen short answers finds auto still careful."""
    ratio = AdaptiveRatio()
    assert ratio.risk == pytest.approx(MODEL_RISK + EARLY_RISK)
    reserved = []
    for n in (0, int(EARLY_HALF), int(4 * EARLY_HALF)):
        while ratio.finished_count < n:
            ratio.finished(req(5, 100, arrival=ratio.finished_count, reason="stop"))
        assert ratio.risk == pytest.approx(early(n))
        plan = ratio.peak_plan([])
        reserved.append(plan.reservation(req(0, 100, prompt=10), 10))
    assert reserved[0] > reserved[1] > reserved[2]
    assert reserved[2] < 0.4 * reserved[0]  # after 4 x EARLY_HALF, mostly what the curve says


def test_requests_outliving_the_curve_lower_its_hazards():
    """The curve says requests stop after 5 of 100 tokens; the running ones do not: the
    calibration scales the hazards down, and new requests are expected to run longer."""
    ratio = AdaptiveRatio()
    for i in range(100):
        ratio.finished(req(5, 100, arrival=i, reason="stop"))
    before = ratio.peak_plan([req(0, 100)]).curve.expected_share(0.0)
    running = [req(2 + k % 3, 100, arrival=100 + k) for k in range(30)]
    for _ in range(10):  # each step predicts a third of them to stop; none does
        ratio.peak_plan(running)
        ratio.step()
    assert ratio.hazard < 0.5
    assert ratio.risk > MODEL_RISK + 0.5
    assert ratio.peak_plan(running).curve.expected_share(0.0) > before


def test_a_workload_turned_long_stays_long_while_nothing_is_due_to_finish():
    """The calibration keeps its evidence through the steps where the curve predicts no stop
    (the running requests past its early stops) and is not reset by requests that end at
    max_new_tokens, a stop on the last allowed token included (certain: the prediction
    leaves them out). Before, ~10 such steps forgot it and the next cohort of a workload
    turned long was admitted on the short curve again (the real model's shift at 3000
    tokens: 0.92x 1.0's tokens per step)."""
    ratio = AdaptiveRatio()
    for i in range(100):
        ratio.finished(req(5, 100, arrival=i, reason="stop"))
    running = [req(2 + k % 3, 100, arrival=100 + k) for k in range(30)]
    for _ in range(10):  # the curve predicts stops; none comes
        ratio.peak_plan(running)
        ratio.step()
    low = ratio.hazard
    assert low < 0.5
    running = [req(60 + k % 3, 100, arrival=100 + k) for k in range(30)]
    for _ in range(50):  # past the curve's stops: nothing predicted, nothing seen
        ratio.peak_plan(running)
        ratio.step()
    assert ratio.hazard == pytest.approx(low, abs=0.02)
    ratio.peak_plan([req(99, 100, arrival=100 + k) for k in range(30)])
    for k in range(30):  # all end at max_new_tokens, half by a stop on the last token
        ratio.finished(req(100, 100, arrival=100 + k, reason="stop" if k % 2 else "length"))
    ratio.step()
    assert ratio.hazard == pytest.approx(low, abs=0.02)
    assert ratio.risk > MODEL_RISK + 0.5


def test_steps_without_a_plan_still_calibrate_the_curve():
    """plan() refuses without planning on most steps between finishes; those steps still
    count, against the last plan's prediction, so the hazard comes out as when every step
    plans (counted on planned steps only, which follow finishes, it was 0.09 or 0.84 here
    where every step planning gives 0.85 and 0.43)."""
    def hazard(gated: bool, every: int) -> float:
        ratio = AdaptiveRatio()
        for i in range(100):
            ratio.finished(req(5 + i % 90, 100, arrival=i, reason="stop"))
        running = [req(10 + k % 3, 100, arrival=100 + k) for k in range(30)]
        for step in range(40):
            (ratio.plan if gated else ratio.peak_plan)(running)
            if step % every == every - 1:  # one request finishes every `every` steps
                ratio.finished(req(6, 100, arrival=200 + step, reason="stop"))
            ratio.step()
        return ratio.hazard

    for every in (2, 3, 5):
        assert hazard(True, every) == pytest.approx(hazard(False, every), abs=0.01)
    assert hazard(False, 2) > 0.8 and hazard(False, 5) < 0.5  # (the scenario discriminates)


def test_the_plan_is_cheap_with_hundreds_running():
    import time

    ratio = AdaptiveRatio()
    for i in range(256):
        ratio.finished(req(i % 200, 400, arrival=i, reason="stop"))
    running = [req(i % 300, 400, prompt=40, arrival=256 + i) for i in range(256)]
    ratio.peak_plan(running)
    start = time.perf_counter()
    for _ in range(20):
        plan = ratio.peak_plan(running)
        plan.reservation(req(0, 400, prompt=40, arrival=600), 40)
    per_step = (time.perf_counter() - start) / 20
    assert per_step < 0.01  # ~0.5 ms on a quiet core; generous for a shared machine


def test_a_sum_plan_keeps_sglangs_arithmetic():
    fixed = NewTokenRatio(1.0)
    running = [req(10, 100), req(0, 50)]
    plan = fixed.plan(running)
    assert plan.held == pytest.approx(0.7 * (90 + 50))
    assert plan.reservation(req(0, 100), 10) == pytest.approx(70)


def test_a_number_keeps_sglangs_schedule_and_bad_values_say_what_to_pass():
    assert isinstance(make_ratio(1.0), NewTokenRatio)
    assert isinstance(make_ratio("auto").peak_plan([]), PeakPlan)
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


def test_requests_of_one_length_are_paced_out_of_lockstep(model):
    """Full-length requests admitted together finish together: a pool filled in lockstep is
    half used on average. Once enough have finished, auto admits them spread out (pacing), so
    it takes fewer steps than 1.0, which breaks the lockstep by retracting. (Its first cohort
    is 1.0's, the floor, and retracts as 1.0's does; after that, pacing.)"""
    prompts, params = workload(64, 32, early_eos=False)
    fixed, auto = (serve(model, c, prompts, params, pool=256) for c in (1.0, "auto"))
    assert auto["outputs"] == fixed["outputs"]
    assert auto["retracted"] < fixed["retracted"], (auto["retracted"], fixed["retracted"])
    assert auto["steps"] < fixed["steps"], (auto["steps"], fixed["steps"])


def test_pacing_refuses_a_second_request_that_would_finish_with_the_first():
    ratio = AdaptiveRatio()
    for i in range(8):  # eight requests ran to max_new_tokens: lengths are all the same
        ratio.finished(req(64, 64, arrival=i, reason="length"))
    ratio.steps = 5
    plan = ratio.peak_plan([], capacity=1024)
    first, second = req(0, 64, arrival=8), req(0, 64, arrival=9)
    assert plan.reservation(first, 10) < 1024
    plan.admitted(first, 10)
    assert plan.reservation(second, 10) == float("inf")  # it would finish in first's bin
    without = ratio.peak_plan([], capacity=None)  # no capacity: no pacing
    without.admitted(first, 10)
    assert without.reservation(second, 10) < 1024


def test_auto_admits_at_least_what_1_0_admits_until_a_retraction():
    """The floor: with nothing learnt (the peak plan holds back 0.9 of the gap to
    max_new_tokens), auto still admits what SGLang's 1.0 admits (0.7 of it); after a
    retraction the floor is off until the batch turned over (as many requests finished as
    were running), and while retractions outnumber 1 + 1 per FLOOR_BUDGET finished. (On a
    machine where the floor pays up to 8 rows, a prompt token costing an eighth of a step, and
    a recomputed token at 2 rows a full row-step; before any step was timed there is no
    floor.)"""
    ratio, fixed = timed_ratio((8.0, 0.02, 1.0)), NewTokenRatio(1.0)
    assert not isinstance(AdaptiveRatio().plan([req(10, 100, prompt=20)]), FloorPlan)
    running = [req(10, 100, prompt=20)]
    pool = 300
    available = pool - sum(r.seq_len for r in running)

    def admitted(plan):
        return len(admit_in_order(plan, available,
                                  [req(0, 100, prompt=10, arrival=1 + i) for i in range(20)]))

    by_floor, by_peak = admitted(fixed.plan(running)), admitted(ratio.peak_plan(running))
    assert by_floor > by_peak  # the cautious start of the peak plan ...
    assert admitted(ratio.plan(running)) == by_floor  # ... is floored at 1.0's
    ratio.after_retraction(running, [req(50, 100, prompt=20)])
    assert admitted(ratio.plan(running)) == by_peak  # a retraction: the peak plan alone ...
    ratio.finished(req(10, 100, arrival=0, reason="stop"))
    assert not isinstance(ratio.plan(running), FloorPlan)
    ratio.finished(req(10, 100, arrival=1, reason="stop"))  # ... until as many finished as
    assert isinstance(ratio.plan(running), FloorPlan)  # were running (and its victim) then
    # retractions beyond 1 + 1 per FLOOR_BUDGET finished requests: off until finishes catch up
    for _ in range(3):
        ratio.after_retraction(running, [req(50, 100, prompt=20)])
    for _ in range(2):
        ratio.finished(req(10, 100, arrival=ratio.finished_count, reason="stop"))
    assert ratio.finished_count < 3 * FLOOR_BUDGET
    assert not isinstance(ratio.plan(running), FloorPlan)
    while ratio.finished_count < 3 * FLOOR_BUDGET:
        ratio.finished(req(10, 100, arrival=ratio.finished_count, reason="stop"))
    assert isinstance(ratio.plan(running), FloorPlan)


def test_the_floor_does_not_override_pacing():
    """1.0 would admit a second full-length request next to the first; pacing refuses it (it
    would finish in the first's bin), and the floor does not overrule that refusal."""
    ratio = timed_ratio(GPU)
    for i in range(8):
        ratio.finished(req(64, 64, arrival=i, reason="length"))
    ratio.steps = 5
    plan = ratio.plan([], capacity=1024)
    assert isinstance(plan, FloorPlan)
    first, second = req(0, 64, arrival=8), req(0, 64, arrival=9)
    assert plan.reservation(first, 10) < 1024
    plan.admitted(first, 10)
    assert NewTokenRatio(1.0).plan([first]).reservation(second, 10) < 1024  # 1.0 would
    assert plan.reservation(second, 10) == float("inf")


def test_the_step_cost_fit_recovers_a_machines_cost_and_starts_from_its_prior():
    from engine.scheduler.step_cost import StepCostFit

    fit = StepCostFit()
    assert fit.cost().tolist() == [0.0, 0.0, 0.0]
    rng = random.Random(0)
    for _ in range(300):  # a CPU-like machine: 2.6 ms + 1.8 ms a row + 1.1 ms a prompt token
        rows = rng.randint(1, 16)
        prompt = rng.choice([0, 0, 0, rng.randint(10, 512)])
        fit.observe(rows, prompt, (2.6 + 1.8 * rows + 1.1 * prompt) / 1e3)
    assert fit.cost() * 1e3 == pytest.approx([2.6, 1.8, 1.1], rel=0.03)
    assert fit.describe().startswith("step 2.6") and "ms/row + 1.1" in fit.describe()
    fit.observe(8, 0, 10.0)  # a step held up 500x: counted as OUTLIER x the fit's time
    assert fit.cost() * 1e3 == pytest.approx([2.6, 1.8, 1.1], rel=0.15)
    one_shape = StepCostFit()  # steps of one shape cannot tell the three apart: the prior holds
    for _ in range(50):
        one_shape.observe(4, 0, 0.012)
    fixed, row, prompt = one_shape.cost()
    assert fixed + 4 * row == pytest.approx(0.012, rel=0.01)
    assert fixed > 0 and row > 0 and prompt > 0


CPU, GPU = (2.6, 1.8, 1.1), (8.0, 0.02, 0.01)  # step costs, ms: fixed, a row, a prompt token


def timed_ratio(machine, max_rows=16) -> AdaptiveRatio:
    """An auto ratio that has seen 200 steps of ``machine`` (ms: fixed, per row, per prompt
    token) of 1 to ``max_rows`` rows."""
    from types import SimpleNamespace

    ratio = AdaptiveRatio()
    rng = random.Random(1)
    for _ in range(200):
        n, prompt = rng.randint(1, max_rows), rng.choice([0, 0, rng.randint(10, 400)])
        ratio.observe(SimpleNamespace(forward_mode="mixed" if prompt else "decode",
                                      generated_tokens=n, new_tokens=prompt,
                                      seconds=(machine[0] + machine[1] * n
                                               + machine[2] * prompt) / 1e3))
    return ratio


def priced(machine, rows=8, victim=(40, 100, 200)) -> float:
    """auto's z for ``rows`` running requests on ``machine`` (timed_ratio)."""
    ratio = timed_ratio(machine)
    for i in range(40):
        ratio.finished(req(30 + i, 200, arrival=i, reason="stop"))
    running = [req(victim[0] + 10 * i, 200, prompt=victim[1], arrival=40 + i)
               for i in range(rows)]
    r = Rows.of(running)
    return ratio.priced_z(ratio.curve(r), r)


def test_a_retraction_is_priced_with_the_machines_own_step_cost():
    """A CPU pays for every prompt token recomputed and gains little from one more row; a
    GPU's small batches cost the same whatever they hold and its prompts little: auto risks
    an overflow there, and holds back here (a higher z)."""
    cpu = priced((2.6, 1.8, 1.1))
    gpu = priced((8.0, 0.02, 0.01))
    untimed = AdaptiveRatio()
    assert untimed.recompute_price(8) == 1.0  # nothing timed: a prompt token = a row-step
    assert cpu > gpu
    assert gpu == pytest.approx(Z_MIN, abs=0.3)
    assert "ms/row" in untimed.describe()
    # a CPU: a recomputed prompt token costs what 3.4 row-steps of gain are worth at 8 rows
    assert timed_ratio((2.6, 1.8, 1.1)).recompute_price(8) == pytest.approx(1.1 * 8 / 2.6,
                                                                           rel=0.05)
    assert timed_ratio((2.6, 1.8, 1.1)).recompute_price(40) == PRICE_MAX


def test_the_floor_runs_only_where_its_overcommit_pays():
    """1.0's overcommit (the floor) buys rows; a CPU pays for each row about what a step's
    fixed part costs, so beyond a few rows the rows gain less than a retraction's recompute
    costs: the floor may fill the batch only up to FIXED / PROMPT rows (``floor_rows``), and
    past them auto admits on its own peak plan with z at least Z_DEAR. A GPU's flat small
    batches keep the floor; before any step was timed there is none."""
    running = [req(50, 100, prompt=50) for _ in range(8)]
    cpu, gpu = timed_ratio(CPU), timed_ratio(GPU)
    for ratio in (cpu, gpu):
        for i in range(40):
            ratio.finished(req(30, 100, arrival=i, reason="stop"))
    assert cpu.floor_rows() == pytest.approx(2.6 / 1.1, rel=0.05)
    assert gpu.floor_rows() > 100 and AdaptiveRatio().floor_rows() == 0
    lockstep = AdaptiveRatio()  # steps of one size cannot tell FIXED from ROW: no floor yet
    for _ in range(300):
        lockstep.step_cost.observe(14, 0, (8.0 + 0.02 * 14) / 1e3)
    lockstep.step_cost.observe(0, 400, (8.0 + 0.01 * 400) / 1e3)
    assert lockstep.step_cost.row_spread == 0 and lockstep.floor_rows() == 0
    assert not lockstep.dear(14)  # nor is z held at Z_DEAR on a cost not known yet
    filling = AdaptiveRatio()  # a batch filling up (5, 9, 14 rows): a spread, but three steps
    for rows in (5, 9, 14):  # are no fit (on the replay its floor let 14 full-length requests
        filling.step_cost.observe(rows, 0, (2.6 + 1.8 * rows) / 1e3)  # in: 5 retractions)
    assert filling.step_cost.row_spread >= 1 and filling.floor_rows() == 0
    for _ in range(COST_STEPS - 3):
        filling.step_cost.observe(14, 0, (2.6 + 1.8 * 14) / 1e3)
    assert filling.floor_rows() > 0
    assert not isinstance(cpu.plan(running), FloorPlan) and cpu.z >= Z_DEAR
    plan = cpu.plan(running[:1])  # one running: the floor may add one more row
    assert isinstance(plan, FloorPlan) and 1 <= plan.room < 2
    assert isinstance(gpu.plan(running), FloorPlan) and gpu.z < Z_DEAR


def test_the_floor_fills_the_batch_only_up_to_its_rows():
    """A floor with room for one request: 1.0's account admits it, the next ones only if the
    peak plan alone admits them, what the scheduler holds staying the peak plan's."""
    ratio, fixed = timed_ratio(GPU), NewTokenRatio(1.0)
    running = [req(10, 100, prompt=20)]
    available = 1000 - sum(r.seq_len for r in running)
    waiting = [req(0, 100, prompt=10, arrival=1 + i) for i in range(20)]
    by_floor = len(admit_in_order(fixed.plan(running), available, waiting))
    by_peak = len(admit_in_order(ratio.peak_plan(running), available, waiting))
    assert by_floor > by_peak + 1
    plan = ratio.plan(running)
    plan.room = 1
    assert len(admit_in_order(plan, available, waiting)) == max(by_peak, 1)


def test_where_recomputing_is_nearly_free_a_retraction_keeps_the_floor_and_the_risk():
    """After a retraction auto turns 1.0's floor off until the batch turned over and raises
    its model risk by the victims' recompute; both in proportion to what a recomputed token
    costs here, so a machine whose prompts are nearly free keeps overcommitting as 1.0 does."""
    running = [req(50, 100, prompt=50)]  # (a CPU's floor adds a row to one)
    victims = [req(20, 100, prompt=50)]
    for machine, floor_kept in (((8.0, 0.02, 0.001), True), (CPU, False)):
        ratio = timed_ratio(machine)
        for i in range(40):
            ratio.finished(req(30, 100, arrival=i, reason="stop"))
        assert isinstance(ratio.plan(running), FloorPlan)
        old, new = ratio.after_retraction(running, victims)
        assert isinstance(ratio.plan(running), FloorPlan) is floor_kept
        assert bool(new - old < 0.01) is floor_kept


def test_the_scheduler_times_each_step_that_ran(model):
    engine = Engine(model, device="cpu", max_total_tokens=512, schedule_conservativeness="auto")
    seen = []
    engine.scheduler.on_step = seen.append
    engine.add_request([5, 6, 7], {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    drain(engine, 50)
    assert seen and all(s.seconds is not None and 0 < s.seconds < 30 for s in seen)
    assert engine.scheduler.ratio.step_cost.steps == len(seen)


def test_after_a_refusal_auto_plans_again_only_once_something_changed():
    """A plan that admitted nothing stands for PLAN_EVERY - 1 more steps (no numpy, no curve)
    unless a request finishes, is retracted or joins the batch; a plan that admitted plans
    again at once."""
    from engine.scheduler.adaptive import PLAN_EVERY, REFUSAL

    ratio = AdaptiveRatio()
    running = [req(50, 100, prompt=50) for _ in range(4)]
    first = ratio.plan(running)
    assert first is not REFUSAL
    plans = [ratio.plan(running) for _ in range(PLAN_EVERY)]
    assert plans[:PLAN_EVERY - 1] == [REFUSAL] * (PLAN_EVERY - 1)
    assert plans[-1] is not REFUSAL  # PLAN_EVERY steps on: planned again
    assert REFUSAL.reservation(req(0, 100), 10) == float("inf") and REFUSAL.held == float("inf")
    ratio.finished(req(30, 100, arrival=1, reason="stop"))
    assert ratio.plan(running) is not REFUSAL  # a finish: planned again
    assert ratio.plan(running + [req(0, 100)]) is not REFUSAL  # the batch changed
    assert ratio.plan(running + [req(0, 100)]) is REFUSAL
    admitting = AdaptiveRatio()  # a plan that admitted: the next step plans again
    real = admitting.plan(running)
    candidate = req(0, 100, prompt=5)
    real.reservation(candidate, 5)
    real.admitted(candidate, 5)
    assert admitting.plan(running) is not REFUSAL
    assert ratio.plan([]) is not REFUSAL  # nothing running: always planned
