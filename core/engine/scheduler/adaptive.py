"""``--schedule-conservativeness auto``: admission against the predicted peak of KV usage.

SGLang's fixed schedule (admission.NewTokenRatio) reserves a share of every running request's
remaining max_new_tokens, a share that decays with steps and jumps back up after a retraction.
``auto`` predicts instead how the pool's usage will evolve and admits a waiting request only if
the predicted *peak* of that usage, with it added, fits the pool:

- How long outputs run: a Kaplan-Meier survival curve S(x) = P(output share > x) of the output
  share x = generated / max_new_tokens, from the finished requests (events) and the running ones
  (right-censored at their current share: they are known to go on at least that far). Using the
  running requests is what keeps the curve from survivorship bias: the first requests to finish
  are the short ones, and a curve from finished requests alone says "everything is short" while
  the long ones are still running. Observations are weighted by recency (by arrival, a half-life
  of HALF_LIFE requests) so that a workload whose lengths drift or change shows in the estimate
  for new requests as soon as the recent ones outlive the old ones; PRIOR_WEIGHT pseudo-requests
  that run to max_new_tokens keep the curve flat beyond the largest observation (conservative:
  what has not been seen to stop is assumed to go on) and few observations from moving it much.
- Requests whose length is known: one with EOS ignored and nothing else that can end it (no
  stop ids, stop strings or grammar: ``peak_plan.runs_to_max``) generates exactly
  max_new_tokens. SGLang's bench_serving and ``engine bench`` send such requests; SGLang's
  schedule still reserves them by its ratio and retracts when they all run on. ``auto`` counts
  each at its exact length (alive with probability 1 until max_new_tokens: no z, no model
  risk), paces them from the first step (their finish times are known; peak_plan.spacing),
  leaves them out of the curve and its calibration (they say nothing about how long the others
  run). 1.0's floor still admits them where its overcommit pays (a flat step: SmolLM2's
  full-length requests replayed at 4000 tokens ran 1.11x 1.0's tokens per step with it, 1.03x
  without; on a CPU's step cost, where the floor stops at ``floor_rows``, the same with or
  without it).
- What the pool will hold: a running request at share p is still alive t steps later with
  probability q(t) = S(p + t/max_new) / S(p) (0 once it reaches max_new_tokens), holding t more
  slots; a finished one gives back what it held. Over a grid of horizons up to the longest
  remaining output, E[Δused(t)] and Var[Δused(t)] are sums over the running requests (and the
  ones admitted this step); a candidate is admitted when max_t E + z·σ still fits (never counted
  above the worst case, every request running to its max_new_tokens: the safety terms end there).
- z, the safety term on that variance, prices a retraction in this machine's seconds
  (step_cost.py: a step's time learnt from the steps run, FIXED + ROW x rows + PROMPT x prompt
  tokens): admitting now rather than at the next chance (when the next request is expected to
  finish) gives G steps of one more row, G tokens that would otherwise take G / n of a step
  at n rows: G x FIXED / n seconds saved; a retraction makes the engine recompute its victim's
  prompt and generated tokens (the victim is the running request with the fewest generated
  tokens), PROMPT x its length, and wait before it runs again (the same gain lost). The
  overflow probability worth accepting is gain / (gain + cost), z its quantile. The price
  of a recomputed token in row-steps, PROMPT x n / FIXED (``recompute_price``), counts in full
  above 1 (up to PRICE_MAX) and below 1 only where far below (x PRICE_TRUST, at most 1); capped
  at 1 it scales what a retraction adds to the model risk and how long it turns the floor off
  (below). So where recomputing is nearly free (a GPU's small batches) auto keeps
  overcommitting as 1.0 does; where a row gains less than a recompute costs (a CPU beyond
  FIXED / PROMPT rows, ``floor_rows``) z is at least Z_DEAR.
- Model risk: the variance above treats requests as independent, but when the workload changes
  (short answers, then long ones) the curve misleads about all of them at once. So a share
  ``risk`` of the gap between the curve's expectation and every request running to its
  max_new_tokens is reserved too: MODEL_RISK always; plus 1 - hazard, where hazard (<= 1) scales
  the curve's hazards (S**hazard) by the finishes seen over those the curve predicted, step by
  step (requests outliving the curve lower it at once, long before they finish), with a memory
  of the last ~10 finishes seen or predicted rather than of the last steps (so the steps where
  nothing is due to finish keep it: a workload turned long stays long for the next cohort), and
  requests that end at max_new_tokens left out of both (certain); plus what retractions added:
  each raises it by RETRACT_RISK x the victims' tokens to recompute over the mean running
  request's length, and that comes back down as requests finish (evidence, counted in requests
  and steps, never in seconds: the same on a slow or a fast machine; no wall-clock hold); plus,
  while little has finished, EARLY_RISK halved every EARLY_HALF finished requests the curve
  learnt from: a curve made of a few dozen short answers says nothing about the next requests if
  the workload changes, and admitting a whole cohort on its word is what retracts: on SmolLM2's
  "Name k fruits." answers turning from short to 400 tokens after 60 requests, 31 retractions of
  requests 116-391 tokens in, where 1.0 retracted 13; with it, 12.
- Pacing (peak_plan.py): requests of one length admitted together finish together, and a pool
  filled in lockstep is on average only (prompt + L/2) / (prompt + L) used (0.55 for prompts of
  28 and L = 256), where requests spread over their lifetimes keep it nearly full. Admitting
  only what fits the peak cannot break such a cohort; SGLang's schedule breaks it by
  overcommitting and retracting. ``auto`` paces instead: the plan also predicts when the
  running requests will finish, in bins one steady-state spacing wide (a request's expected
  token-steps, prompt x E[L] + E[L^2] / 2, over the pool's tokens: the steps between two
  finishes when the pool is kept full) and fixed in time (counted in decode steps), and admits
  a candidate only while the requests expected to finish in its bin, itself included, stay
  within PACE_SLACK. Requests whose lengths spread (chat) never come near it; equal lengths are
  admitted about one spacing apart, so that they finish spread out. It applies once
  PACE_MIN_FINISHED requests finished (before that the curve is only its prior, which says
  every request runs to max_new_tokens).
- The floor (``FloorPlan``): a candidate SGLang's schedule at conservativeness 1.0 would admit
  (its own ratio, stepped and reset alongside) is admitted too, unless pacing refuses it, a
  retraction happened lately (until as many requests have finished as were running then: the
  batch turned over once), or retractions have been more than one plus one per FLOOR_BUDGET
  finished requests (their price, the recompute, is then paid too often for what the floor's
  extra rows gain), and only while the batch stays under ``floor_rows``: FIXED / PROMPT, the
  rows at which one more row gains what a recomputed token costs (a GPU's small batches:
  hundreds; SmolLM2 on a 2-core Zen 5: 4-10 in `engine serve`, so at larger batches the peak
  plan admits alone), once the decode steps seen held batches of different sizes (before that
  the fit cannot tell FIXED from ROW). On the real model at 4000 tokens this took auto from
  6 retractions to 0 on fruits and from 9-11 to 0 on full-length requests, faster than 1.0
  (docs/scheduling.md). Earlier, on SmolLM2's recorded lengths (conservativeness_replay.py)
  the peak plan alone held back too much where 1.0 runs many requests with few retractions
  (pool 8000, fruits: 0.81x 1.0's tokens per step; floored 1.07x) and lost 3% on full-length
  requests at 4000 (floored 1.02x, 5 retractions against 1.0's 27). Pacing keeps its veto
  because 1.0's cohorts are what it breaks up (overruled, full-length fell to 0.84x); the gate
  and the budget because a floor that re-admits right after retracting locks into a retraction
  every request lifetime (full-length at 4000: 10-11 running), and without the budget the
  random model's full-length requests were retracted 97 times against 1.0's 57 (31 with it).
"""

from __future__ import annotations

import math
from collections import deque
from statistics import NormalDist

import numpy as np

from engine.scheduler.admission import NewTokenRatio, SumPlan, reservable_tokens
from engine.scheduler.peak_plan import PeakPlan, Rows, runs_to_max
from engine.scheduler.step_cost import StepCostFit
from engine.scheduler.survival import SurvivalCurve

AUTO = "auto"
WINDOW = 256  # finished requests the curve remembers (with the running ones)
HALF_LIFE = 48.0  # an observation's weight halves every this many later arrivals
PRIOR_WEIGHT = 0.5  # pseudo-requests running to max_new_tokens (weight of a fresh request: 1)
Z_MIN, Z_MAX = 0.5, 4.0  # the priced z is kept in this range
Z_DEAR = 2.0  # ... and at least this where a recompute costs more than a row gains (no floor)
MODEL_RISK = 0.2  # share of the gap to running to max_new_tokens always reserved
RETRACT_RISK = 0.3  # a retraction adds this x its recompute / the mean running length ...
RETRACTION_RISK_MAX = 1.0
RISK_DECAY = 1 / 16  # ... which falls by this share per request that finishes
CALIBRATION_DECAY = 0.9  # per finish seen or predicted: finishes seen vs predicted, over ~10 ...
CALIBRATION_PRIOR = 0.5  # ... starting from (and pulled towards) this many of each
HAZARD_MIN = 0.05
EARLY_RISK = 0.7  # more model risk while little has finished: EARLY_RISK x 0.5 ** (finished
EARLY_HALF = 32.0  # / EARLY_HALF): the first admissions hold back about as SGLang's 0.7 does
FLOOR_BUDGET = 16  # the floor holds while victims number at most 1 + 1 per this many finished
PRICE_TRUST = 4.0  # a learnt recompute price counts only where it is far below 1 (x this)
PRICE_MAX = 4.0  # ... and above 1 up to this
ROW_SPREAD = 1.0  # the floor waits for decode steps whose rows spread this much (floor_rows)
COST_STEPS = 16  # ... over at least this many of them (two steps of a filling batch are not a fit)
PLAN_EVERY = 4  # after a plan that admitted nothing, the next ones only every this many steps
# until a request finishes, is retracted or is added to the batch (``plan``)
PACE_MIN_FINISHED = 8  # pacing (peak_plan.py) once this many requests finished: before that
# the curve is only its prior


def make_ratio(conservativeness):
    """The ratio object for ``--schedule-conservativeness``: a number keeps SGLang's schedule."""
    if conservativeness == AUTO:
        return AdaptiveRatio()
    return NewTokenRatio(conservativeness)


def _share(req) -> float:
    return min(len(req.output_ids) / req.params.max_new_tokens, 1.0)


class AdaptiveRatio:
    """``auto``: the survival curve of output shares, calibrated against the finishes it
    predicts; z priced from a retraction's cost; model risk raised by retractions; the peak
    admission (``plan``). Same interface as NewTokenRatio (``plan``, ``reserve``, ``step``,
    ``finished``, ``observe``, ``after_retraction``, ``value``)."""

    def __init__(self):
        # finished requests: share, arrival (events of the curve)
        self.done_share: deque[float] = deque(maxlen=WINDOW)
        self.done_arrival: deque[int] = deque(maxlen=WINDOW)
        self.retraction_risk = 0.0  # what retractions added to the risk (decays as requests finish)
        self.z = Z_MIN  # the last plan's z (for logs)
        self.last_curve: SurvivalCurve | None = None
        self.retractions = 0
        # calibration: finishes seen / finishes the curve predicted, per step (decaying)
        self.seen_finishes = self.predicted_finishes = CALIBRATION_PRIOR
        self._predicted_now: float | None = None  # what this step's plan expects to finish
        self._finished_now = 0
        self.steps = 0  # decode steps (pacing's clock)
        self.finished_count = 0
        self.observed = 0  # finished requests the curve learnt from (not runs_to_max ones)
        self.floor = NewTokenRatio(1.0)  # what --schedule-conservativeness 1.0 admits (FloorPlan)
        self.victims = 0  # requests retracted so far (the floor's budget)
        self.floor_off_until = 0  # finished requests: the floor is off after a retraction
        self.step_cost = StepCostFit()  # this machine's step time (prices a retraction)
        self._last_plan = None  # the last plan made, what it was made on, the steps since
        self._last_key: tuple | None = None
        self._skipped = 0
        self._last_predicted = 0.0  # the finishes the last plan expected in its step

    @property
    def hazard(self) -> float:
        """The curve's hazards are scaled by this (S**hazard): when the running requests finish
        less often than the curve says (the workload got longer), it falls below 1."""
        return min(max(self.seen_finishes / self.predicted_finishes, HAZARD_MIN), 1.0)

    @property
    def risk(self) -> float:
        """The share of the gap between the curve's expectation and running to max_new_tokens
        reserved as model risk: MODEL_RISK, plus how far the curve over-predicted finishes
        lately (1 - hazard), plus what retractions added."""
        early = EARLY_RISK * 0.5 ** (self.observed / EARLY_HALF)
        return min(MODEL_RISK + early + (1 - self.hazard) + self.retraction_risk, 1.0)

    # -- the curve ---------------------------------------------------------------------------
    def curve(self, rows: Rows | None = None) -> SurvivalCurve:
        """Finished requests (events) and ``rows`` (running: censored at their share), weighted
        by arrival recency, plus PRIOR_WEIGHT censored at share 1; calibrated by ``hazard``."""
        rows = rows if rows is not None else Rows.of([])
        natural = ~rows.certain  # requests certain to run to max_new_tokens say nothing of it
        done_share = np.fromiter(self.done_share, np.float64, len(self.done_share))
        done_arrival = np.fromiter(self.done_arrival, np.float64, len(self.done_arrival))
        arrivals = np.concatenate([done_arrival, rows.arrival[natural]])
        newest = arrivals.max() if len(arrivals) else 0.0
        weights = np.concatenate([0.5 ** ((newest - arrivals) / HALF_LIFE), [PRIOR_WEIGHT]])
        shares = np.concatenate([done_share, rows.p[natural], [1.0]])
        events = np.concatenate([np.ones(len(done_share), bool),
                                 np.zeros(int(natural.sum()) + 1, bool)])
        self.last_curve = SurvivalCurve(shares, events, weights, self.hazard)
        return self.last_curve

    def finished(self, req) -> None:
        if req.finish_reason in ("stop", "length") and req.params.max_new_tokens:
            self.finished_count += 1
            self.retraction_risk *= 1 - RISK_DECAY
            if runs_to_max(req):  # its length was known: no evidence about the others'
                return
            self.observed += 1
            self.done_share.append(_share(req))
            self.done_arrival.append(req.arrival)
            # one the plan's prediction covered: "length", or a stop on the last token
            # max_new_tokens allowed, was certain (_expected_finishes leaves those out)
            self._finished_now += req.finish_reason == "stop" and \
                len(req.output_ids) < req.params.max_new_tokens

    # -- z -----------------------------------------------------------------------------------
    def priced_z(self, curve: SurvivalCurve, rows: Rows) -> float:
        """The normal quantile of the overflow probability worth accepting, gain / (gain +
        cost): gain = the steps until the next request is expected to finish (admitting now
        rather than then buys that many steps of one more row), cost = the likely victim's
        recompute (its prompt + generated tokens, the victim being the running request with
        the fewest generated; x ``recompute_price``) plus the same wait before it runs
        again."""
        if len(rows.p) == 0:
            return Z_MIN
        gain = 1.0 / max(self._expected_finishes(curve, rows), 1e-6)
        cost = self.recompute_price(len(rows.p)) * rows.victim_len + gain
        z = NormalDist().inv_cdf(1 - gain / (gain + cost))
        return min(max(z, Z_DEAR if self.dear(len(rows.p)) else Z_MIN), Z_MAX)

    def measured_price(self, rows: float) -> float:
        """A recomputed token's cost in row-steps of the gain at ``rows`` running: PROMPT /
        (FIXED / n) from the step times seen (1 before any was seen). Above 1 a retraction's
        recompute costs more than the rows an overcommit adds gain (a CPU: each row costs
        about as much as the fixed part of a step, so one more row gains little)."""
        if self.step_cost.steps == 0:
            return 1.0
        fixed, _, prompt = self.step_cost.cost()
        return float(prompt * rows / fixed)

    def recompute_price(self, rows: float) -> float:
        """The price z's cost uses (``priced_z``): the measured one where it is above 1 (at
        most PRICE_MAX); below 1 only where far below (x PRICE_TRUST, at most 1).

        A price below 1 counts only where far lower: on a CPU the line misses what a step pays
        whatever it holds, and with the batch at the same size for hundreds of steps its FIXED
        and ROW trade places (SmolLM2 on a 2-core Zen 5 fitted 2.6 to 15 ms + 1.25 to 0 ms a
        row over one run: a price of 0.3 to 2.3 at 8 rows). A GPU's small batches (a flat
        step, prompts nearly free) give prices of a few hundredths, which stay low."""
        price = self.measured_price(rows)
        return min(price, PRICE_MAX) if price >= 1 else min(PRICE_TRUST * price, 1.0)

    def floor_rows(self) -> float:
        """The batch up to which 1.0's overcommit (``FloorPlan``) pays for its retractions:
        the rows at which a recomputed token costs a row-step of gain (``measured_price`` 1:
        FIXED / PROMPT). A GPU's small batches: hundreds; a CPU: a few (SmolLM2 on a 2-core
        Zen 5: 4-10 in `engine serve`, 2.3 with the replay's 2.6 ms fixed and 1.13 ms a prompt
        token), so past them auto admits on its peak plan alone, with z at least Z_DEAR.
        None before COST_STEPS decode steps were seen and their rows spread by ROW_SPREAD
        (``cost_known``): until then the fit cannot tell a step's fixed part from its rows',
        and the first admissions come from the peak plan, whose early risk holds back as 1.0's
        0.7 does. (A batch filling up, 5, 9, 14 rows in its first steps, passed the spread
        gate alone: on SmolLM2's full-length requests replayed at 4000 tokens with a CPU's
        step cost the floor that two steps' fit allowed let 14 requests in at once, 5
        retractions against 1.0's 29; since the COST_STEPS gate, 0, and 0 against 27 on the
        real model. A spread of 2 rows had avoided it but held the floor back on a flat-cost
        machine's fruits at 2500: 0.89x of 1.0's tokens per step.)"""
        if not self.cost_known():
            return 0.0
        fixed, _, prompt = self.step_cost.cost()
        return float(fixed / prompt) if prompt > 0 else float("inf")

    def cost_known(self) -> bool:
        """Whether the steps seen tell a step's fixed part from its rows' (``floor_rows``)."""
        return self.step_cost.decode_steps >= COST_STEPS and \
            self.step_cost.row_spread >= ROW_SPREAD

    def dear(self, running: int) -> bool:
        """Whether, as far as the steps seen tell, the batch an admission here fills is past
        ``floor_rows`` (a row gains less than a recomputed token costs): z is then at least
        Z_DEAR. Not before the cost is known (a GPU's first steps must not hold back)."""
        return self.cost_known() and self.batch_rows(running) > self.floor_rows()

    def batch_rows(self, running: int) -> float:
        """The rows an admission here is for: ``running``, or the batch the steps seen held on
        average if larger (the running requests are few right after a cohort finished, and an
        admission then fills the batch again)."""
        return max(float(running), self.step_cost.mean_rows)

    @staticmethod
    def _expected_finishes(curve: SurvivalCurve, rows: Rows) -> float:
        """How many of ``rows`` ``curve`` expects to finish (stop) in the coming step."""
        live = (rows.rem > 1) & ~rows.certain  # a known length's finish is no prediction
        p, m = rows.p[live], rows.m[live]
        now = curve(p)
        nxt = curve(p + 1 / m)
        return float(np.where(now > 0, 1 - nxt / np.where(now > 0, now, 1.0), 0.0).sum())

    # -- the scheduler's interface -------------------------------------------------------------
    def plan(self, running, capacity: int | None = None) -> PeakPlan | FloorPlan | Refusal:
        """This step's admission: the peak plan, with 1.0's admissions as a floor unless a
        retraction happened lately or too many did (``FloorPlan``).

        A plan costs ~0.4 ms of Python and numpy, 3-5% of a CPU decode step of SmolLM2, and
        between two finishes the running requests only grow, each as the last plan foresaw:
        its refusal stands. So after a plan that admitted nothing, with requests running and
        none finished, retracted or added since, the next PLAN_EVERY - 1 steps refuse without
        planning (``Refusal``; a request arriving meanwhile waits those steps at most), or
        fewer where pacing refused a request of known length: only until its finish would
        move into the next bin (``PeakPlan.paced``)."""
        key = (self.finished_count, self.retractions, len(running))
        last = self._last_plan
        # a certain candidate refused by pacing: until its finish reaches the next bin
        stands = min(math.ceil(last.paced), PLAN_EVERY) if last is not None and last.paced \
            else PLAN_EVERY
        if running and last is not None and key == self._last_key and \
                self._skipped < stands - 1 and not last.peak_admissions:
            self._skipped += 1
            # the calibration goes on every step: the finishes this step's forward brings
            # against the last plan's prediction (comparing only on planned steps, which follow
            # finishes, would oversample the steps rich in finishes and hold the hazard at 1)
            self._predicted_now, self._finished_now = self._last_predicted, 0
            return REFUSAL
        plan = self.peak_plan(running, capacity)
        self._last_key, self._skipped = key, 0
        room = self.floor_rows() - len(running)  # rows the floor may add (its overcommit pays)
        if self.finished_count < self.floor_off_until or room < 1 or \
                self.victims > 1 + self.finished_count / FLOOR_BUDGET:
            self._last_plan = plan
            return plan
        self._last_plan = FloorPlan(SumPlan(self.floor, running), plan, room)
        return self._last_plan

    def peak_plan(self, running, capacity: int | None = None) -> PeakPlan:
        """The admission against the predicted peak; ``capacity`` (the pool's tokens) turns
        pacing on once PACE_MIN_FINISHED requests finished."""
        rows = Rows.of(running)
        curve = self.curve(rows)
        self.z = self.priced_z(curve, rows)
        pending = float(sum(r.seq_len - r.alloc_len for r in running if r.seq_len > r.alloc_len))
        plan = PeakPlan(curve, rows, pending, self.z, self.risk, capacity, self.steps,
                        curve_paces=len(self.done_share) >= PACE_MIN_FINISHED)
        # the calibration compares the uncalibrated curve's prediction with what happens
        self._predicted_now = self._expected_finishes(curve, rows) / self.hazard
        self._last_predicted = self._predicted_now
        self._finished_now = 0  # the finishes of this step's forward are what it predicted
        return plan

    def reserve(self, req) -> float:
        """The tokens ``req`` is expected to add (for reports; admission goes through plan)."""
        remaining = reservable_tokens(req)
        if not remaining or not req.params.max_new_tokens:
            return 0.0
        if runs_to_max(req):
            return float(remaining)
        curve = self.last_curve or self.curve()
        return min(curve.expected_share(_share(req)) * req.params.max_new_tokens, remaining)

    @property
    def value(self) -> float:
        """The share of max_new_tokens a new request is expected to generate (for logs)."""
        return (self.last_curve or self.curve()).expected_share(0.0)

    def step(self) -> None:
        """A decode step ran: fold its finishes and the plan's prediction into the calibration."""
        self.steps += 1
        self.floor.step()
        if self._predicted_now is None:  # no plan this step: nothing to compare
            self._finished_now = 0
            return
        # decayed per finish seen or predicted, not per step: the steps where nothing is due to
        # finish (requests past the curve's early stops, or running to max_new_tokens) keep
        # the evidence instead of forgetting it in ~10 steps (then every new cohort of a
        # workload turned long was admitted on the stale curve again)
        d = CALIBRATION_DECAY ** (self._finished_now + self._predicted_now)
        prior = (1 - d) * CALIBRATION_PRIOR
        self.seen_finishes = d * self.seen_finishes + self._finished_now + prior
        self.predicted_finishes = d * self.predicted_finishes + self._predicted_now + prior
        self._finished_now, self._predicted_now = 0, None

    def observe(self, stats) -> None:
        """The step's stats: its time teaches the step-cost fit (the plan reads the requests
        themselves)."""
        if stats.seconds is not None and stats.forward_mode != "idle":
            self.step_cost.observe(stats.generated_tokens, stats.new_tokens, stats.seconds)

    def after_retraction(self, running, victims=()) -> tuple[float, float]:
        """Raise the model risk by what the retraction cost: the victims' tokens to recompute,
        in units of the mean running request's length, x RETRACT_RISK. Returns the risk before
        and after (the log line's pair)."""
        old = self.risk
        self.floor.after_retraction(running, victims)
        lengths = [r.seq_len for r in running]
        mean_len = max(sum(lengths) / len(lengths), 1.0) if lengths else 1.0
        cost = sum(v.seq_len for v in victims) if victims else mean_len
        price = min(self.recompute_price(len(running) + len(victims)), 1.0)
        self.retraction_risk = min(self.retraction_risk + RETRACT_RISK * price * cost / mean_len,
                                   RETRACTION_RISK_MAX)
        self.retractions += 1
        self.victims += max(len(victims), 1) * price  # priced: cheap ones count less
        # off until as many requests finished as were running: the batch turned over once
        self.floor_off_until = self.finished_count + round(price * (len(running)
                                                                    + len(victims)))
        return old, self.risk

    def describe(self) -> str:
        return (f"auto: a new request is expected to generate {self.value:.3f} of max_new_tokens "
                f"({len(self.done_share)} finished); z {self.z:.2f}, hazard x{self.hazard:.2f}, "
                f"model risk {self.risk:.2f} (retractions {self.retraction_risk:.2f}; "
                f"{self.retractions} retraction steps); {self.step_cost.describe()}; "
                f"1.0's floor {self._floor_words()}")

    def _floor_words(self) -> str:
        if not self.cost_known():
            return "off until the steps tell a step's fixed part from its rows'"
        rows = self.floor_rows()
        if rows == float("inf"):
            return "at any batch"
        return f"up to {rows:.1f} rows" if rows >= 1 else "off"


class Refusal:
    """A step's admission that admits nothing (``AdaptiveRatio.plan`` between two finishes)."""

    held = float("inf")
    peak_admissions = 0
    paced = 0.0

    def reservation(self, req, extend: int) -> float:
        return float("inf")

    def admitted(self, req, extend: int) -> None:
        raise AssertionError("a refusal admits nothing")


REFUSAL = Refusal()


class FloorPlan:
    """The peak plan with SGLang's 1.0 schedule as a floor: a candidate is admitted when either
    would admit it (``auto`` never admits less than 1.0), except that pacing's refusal stands
    (admitting into a crowd of finishes is what builds the lockstep cohorts pacing breaks up),
    and the floor's account admits at most ``room`` requests (``AdaptiveRatio.floor_rows``
    less the running ones): after them a candidate must fit the peak plan alone. Each plan
    keeps its own account of what this step's admissions promised."""

    def __init__(self, floor: SumPlan, peak: PeakPlan, room: float = float("inf")):
        self.floor, self.peak = floor, peak
        self.r_floor, self.r_peak = floor.held, peak.held
        self.held = min(self.r_floor, self.r_peak)
        self.room = room  # requests the floor may still add (AdaptiveRatio.floor_rows)
        self._last = None

    @property
    def peak_admissions(self) -> int:
        return self.peak.peak_admissions

    @property
    def paced(self) -> float:
        return self.peak.paced

    def reservation(self, req, extend: int) -> float:
        # once the floor's room is used up its account stops counting (inf): the peak alone
        by_floor = self.r_floor + self.floor.reservation(req, extend) if self.room >= 1 \
            else float("inf")
        by_peak = self.r_peak + self.peak.reservation(req, extend)  # inf: pacing refuses
        self._last = (req, extend, by_floor, by_peak)
        if by_peak == float("inf"):
            return by_peak
        # the scheduler admits when extend + this fits the room left after self.held and the
        # reservations returned so far: i.e. when the lower of the two accounts fits
        return min(by_floor, by_peak) - min(self.r_floor, self.r_peak)

    def admitted(self, req, extend: int) -> None:
        last = self._last
        if last is None or last[0] is not req or last[1] != extend:
            self.reservation(req, extend)
        # (admitted on the peak alone: r_floor inf, so what the scheduler holds is r_peak)
        _, _, self.r_floor, self.r_peak = self._last
        self.room -= 1
        self.peak.admitted(req, extend)
