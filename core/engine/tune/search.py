"""The budget-bounded search: coordinate descent from the defaults over the knobs in the guides'
order, each ordered knob walked one step at a time in the direction the guides' rules name
first (the other way pruned when a rule says so), and `grid`, the exhaustive baseline.

``evaluate(config) -> Trial`` measures one configuration (engine.tune.measure.Evaluator for
real; the tests give a fake cost function); the search judges it with the Objective."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from engine.registry import EngineError
from engine.tune.knobs import Knob
from engine.tune.rules import ADMISSION_KNOBS, client_bound, hints
from engine.tune.trial import INFEASIBLE, NOT_APPLICABLE, OK, Objective, Trial


@dataclass
class TuneResult:
    knobs: list[Knob]
    trials: list[Trial]
    notes: list[str] = field(default_factory=list)  # what the rules concluded, why it stopped
    seconds: float = 0.0

    @property
    def defaults(self) -> Trial:
        return self.trials[0]

    @property
    def best(self) -> Trial | None:
        ok = [t for t in self.trials if t.score is not None]
        return max(ok, key=lambda t: t.score) if ok else None

    @property
    def gain(self) -> float | None:
        """The best trial's throughput over the defaults' (both measured here)."""
        best, base = self.best, self.defaults
        if best is None or base.measured is None or not base.measured.output_throughput:
            return None
        return best.measured.output_throughput / base.measured.output_throughput

    def as_dict(self) -> dict:
        best = self.best
        return {"trials": [t.as_dict() for t in self.trials], "notes": self.notes,
                "best": best.as_dict() if best else None, "gain": self.gain,
                "seconds": self.seconds,
                "live": sum(t.how == "live" for t in self.trials),
                "restarts": sum(t.how == "restart" for t in self.trials)}


class _Run:
    """The trials so far, the budget, and the one way to start another."""

    def __init__(self, knobs, evaluate, objective, budget_s, clock, on_trial):
        self.knobs, self.evaluate, self.objective = knobs, evaluate, objective
        self.budget_s, self.clock, self.on_trial = budget_s, clock, on_trial
        self.start = clock()
        self.result = TuneResult(list(knobs), [])
        self.seen: dict[tuple, Trial] = {}
        self.out_of_budget = False

    def estimate(self, live: bool) -> float:
        """Seconds the next trial may take: the longest past one of its kind (live or not), so
        that a trial is started only where it fits the budget."""
        trials = self.result.trials
        same = [t.seconds for t in trials if (t.how == "live") == live] or \
            [t.seconds for t in trials]
        return max(same, default=0.0)

    def trial(self, config: dict, live: bool = False) -> Trial | None:
        """Measure ``config`` (once: a repeat returns the first trial); None when the budget
        does not leave room for it."""
        key = tuple(sorted(config.items(), key=lambda kv: kv[0]))
        if key in self.seen:
            return self.seen[key]
        if self.budget_s is not None and self.result.trials and (
                self.clock() - self.start + self.estimate(live) > self.budget_s):
            if not self.out_of_budget:
                self.result.notes.append(
                    f"stopped: the budget ({self.budget_s / 60:g} min) leaves no room for "
                    f"another trial (up to {self.estimate(live):.1f} s each)")
            self.out_of_budget = True
            return None
        t0 = self.clock()
        t = self.evaluate(dict(config))
        t.seconds = self.clock() - t0  # on the budget's clock
        if t.status == OK:
            t.status, t.reason = self.objective.judge(t.measured)
        t.index = len(self.result.trials)
        self.result.trials.append(t)
        self.seen[key] = t
        if self.on_trial:
            self.on_trial(t)
        return t

    def better(self, t: Trial | None, than: Trial, min_gain: float) -> bool:
        if t is None or t.score is None:
            return False
        return than.score is None or t.score > than.score * (1 + min_gain)


def search(knobs: list[Knob], evaluate, objective: Objective | None = None, *,
           budget_s: float | None = None, clock=time.monotonic, on_trial=None,
           min_gain: float = 0.02, max_passes: int = 2) -> TuneResult:
    """Coordinate descent from the defaults (see the module docstring). A move is taken when
    it beats the incumbent by more than ``min_gain`` (noise is not a direction); the answer is
    the best feasible trial measured. Passes repeat while one improved, up to ``max_passes``."""
    run = _Run(knobs, evaluate, objective or Objective(), budget_s, clock, on_trial)
    res = run.result
    current = {k.name: k.default for k in knobs}
    incumbent = run.trial(current)
    if incumbent.status == NOT_APPLICABLE:
        raise EngineError(f"the defaults cannot run: {incumbent.reason}")
    active = list(knobs)
    m = incumbent.measured
    if m is not None and client_bound(m):
        dropped = [k.name for k in active if k.name in ADMISSION_KNOBS]
        active = [k for k in active if k.name not in ADMISSION_KNOBS]
        if dropped:
            res.notes.append(
                f"client-bound: #queue-req stayed 0 with the defaults (every request was "
                f"admitted as it came), so {', '.join(dropped)} cannot help: not searched; send "
                f"more requests at once (a higher --request-rate or more --num-prompts) to "
                f"tune them")
    for _ in range(max_passes):
        moved = False
        for knob in active:
            hint = {h.knob: h for h in hints(incumbent.measured)} if incumbent.measured else {}
            moves = _moves(knob, current, hint.get(knob.name), res)
            improved = None
            while True:
                try:
                    config = moves.send(improved)
                except StopIteration:
                    break
                t = run.trial(config, knob.live)
                if t is None:
                    break
                improved = run.better(t, incumbent, min_gain)
                if improved:
                    incumbent, current, moved = t, config, True
            if run.out_of_budget:
                break
        if not moved or run.out_of_budget:
            break
    res.seconds = clock() - run.start
    return res


def _moves(knob: Knob, current: dict, hint, res: TuneResult):
    """The configurations to try for ``knob`` from ``current`` (a generator told by send()
    whether the last one improved): an ordered knob is walked a step at a time while it
    improves (the hinted direction first, the other unless pruned or the first improved), then
    its words ("auto"); any other knob's values one by one."""
    value = current[knob.name]
    if not knob.ordered:
        for v in knob.values:
            if v != value and (yield {**current, knob.name: v}):
                current = {**current, knob.name: v}
        return
    scale = [v for v in knob.values if not isinstance(v, str)]
    if value in scale:
        first = hint.direction if hint else -1
        directions = [first] if hint and hint.prune_other else [first, -first]
        if hint:
            note = (f"rule: {hint.reason} ({knob.flag}: {'lower' if first < 0 else 'higher'} "
                    f"first{', the other way pruned' if hint.prune_other else ''})")
            if note not in res.notes:
                res.notes.append(note)
        start = scale.index(value)
        for d in directions:
            pos, moved = start, False
            while 0 <= pos + d < len(scale):
                pos += d
                if not (yield {**current, knob.name: scale[pos]}):
                    break
                moved, current = True, {**current, knob.name: scale[pos]}
            if moved:
                break  # it improved this way: the other way is behind the incumbent
    for v in knob.values:
        if isinstance(v, str) and v != current[knob.name]:
            if (yield {**current, knob.name: v}):
                current = {**current, knob.name: v}


def grid(knobs: list[Knob]) -> list[dict]:
    """Every combination of the knobs' values; restart-only knobs vary slowest, so that a run
    over them restarts the engine as rarely as possible."""
    order = sorted(knobs, key=lambda k: k.live)
    return [dict(zip((k.name for k in order), combo))
            for combo in itertools.product(*(k.values for k in order))]


def run_grid(knobs: list[Knob], evaluate, objective: Objective | None = None, *,
             clock=time.monotonic, on_trial=None) -> TuneResult:
    """Measure every configuration of ``grid(knobs)`` (the defaults first)."""
    run = _Run(knobs, evaluate, objective or Objective(), None, clock, on_trial)
    defaults = {k.name: k.default for k in knobs}
    run.trial(defaults)
    for config in grid(knobs):
        run.trial(config)
    run.result.seconds = clock() - run.start
    return run.result


__all__ = ["INFEASIBLE", "TuneResult", "grid", "run_grid", "search"]
