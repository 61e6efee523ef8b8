"""`engine tune` as a library: search the tuning guides' knobs for the best output throughput
under SLOs, measuring each configuration with engine.bench.

- knobs.py: the knobs, their candidates, which can change live; trial.py: `Trial` and the
  `Objective`; rules.py: the guides' rules as proposals; search.py: the search and `grid`;
  live.py: setting a knob on a running engine; measure.py: the real `Evaluator`;
  report.py: what the CLI prints.
"""

from engine.tune.knobs import Knob, default_knobs, select
from engine.tune.measure import Evaluator
from engine.tune.search import TuneResult, grid, run_grid, search
from engine.tune.trial import Measured, Objective, Trial

__all__ = ["Evaluator", "Knob", "Measured", "Objective", "Trial", "TuneResult", "default_knobs",
           "grid", "run_grid", "search", "select"]
