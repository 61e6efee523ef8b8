"""Measuring one configuration for real: the workload through an in-process Engine (what
`engine bench offline` measures). The engine is kept between trials and the live knobs are set
on it when only they change; anything else starts a new Engine."""

from __future__ import annotations

import time

from engine.registry import EngineError
from engine.stats import is_out_of_memory
from engine.tune.live import live_problem, reset_for_run, set_live
from engine.tune.trial import INFEASIBLE, NOT_APPLICABLE, OK, Measured, Trial


def _start_engine(kwargs: dict):
    from engine.engine import Engine

    return Engine(**kwargs)


def warm_up(engine, workload, max_concurrency: int | None = None) -> None:
    """The workload once, discarded, on a new engine: the first runs in a process are several
    times slower (each new batch shape builds its kernels), which would count against whatever
    configuration happens to start first."""
    from engine.bench import run_bench

    run_bench(engine, workload, max_concurrency=max_concurrency)


class Evaluator:
    """``evaluate(config) -> Trial`` for engine.tune.search: ``fixed``, the engine flags not
    searched (Engine keyword arguments); ``start(kwargs)``: builds an Engine (a stand-in in
    tests)."""

    def __init__(self, fixed: dict, workload, *, max_concurrency: int | None = None,
                 start=_start_engine, warm=True, clock=time.perf_counter):
        self.fixed, self.workload, self.max_concurrency = dict(fixed), workload, max_concurrency
        self.start, self.warm, self.clock = start, warm, clock
        self.engine = None
        self.started_with: dict | None = None  # the searched knobs the engine started with

    def _restart_needed(self, config: dict) -> bool:
        if self.engine is None:
            return True
        for name, value in config.items():
            if value != self.started_with[name] and live_problem(self.engine, name, value):
                return True
        return False

    def _prepare(self, config: dict) -> str:
        if self._restart_needed(config):
            self.close()
            self.engine = self.start({**self.fixed, **config})
            self.started_with = dict(config)
            if self.warm:
                warm_up(self.engine, self.workload, self.max_concurrency)
            how = "restart"
        else:
            for name, value in config.items():
                if value != getattr(self.engine.config, name):
                    set_live(self.engine, name, value)
            how = "live"
        reset_for_run(self.engine)
        return how

    def __call__(self, config: dict) -> Trial:
        from engine.bench import run_bench

        t0, how = self.clock(), "restart"
        try:
            how = self._prepare(config)
            result = run_bench(self.engine, self.workload, max_concurrency=self.max_concurrency)
        except EngineError as e:  # refused here (a backend unusable on this device, a workload
            self.close()          # request that does not fit this configuration, ...)
            return Trial(config, NOT_APPLICABLE, str(e), seconds=self.clock() - t0, how=how)
        except Exception as e:
            if not is_out_of_memory(e) or self.engine is None:
                raise
            in_prefill = self.engine.scheduler.counters.prefill_oom_errors > 0
            self.close()  # its requests are half-run: the next trial starts a new engine
            m = Measured(0.0, float("nan"), float("nan"), 0, None, None, None, None,
                         self.clock() - t0, prefill_oom=in_prefill)
            where = "in prefill" if in_prefill else "while decoding"
            return Trial(config, INFEASIBLE, f"out of memory {where}: {e}", m,
                         self.clock() - t0, how)
        return Trial(config, OK, "", Measured.of(result), self.clock() - t0, how)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = self.started_with = None
