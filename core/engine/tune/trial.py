"""One measured configuration (`Trial`), and the objective that ranks them: output throughput,
subject to the SLOs; a failed request, an out-of-memory error or a refused flag is never best."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

OK, INFEASIBLE, NOT_APPLICABLE = "ok", "infeasible", "n/a"


@dataclass
class Measured:
    """What the tuner keeps of a BenchResult: the objective's numbers and the rules' signals."""

    output_throughput: float
    ttft_p99_ms: float
    itl_p99_ms: float
    failed: int
    mean_token_usage: float | None
    mean_queue_reqs: float | None
    peak_queue_reqs: float | None
    retractions: int | None
    duration_s: float
    completed: int = 0
    prefill_oom: bool = False  # the run died of out-of-memory in a prefill step

    @classmethod
    def of(cls, r) -> "Measured":
        return cls(r.output_throughput, r.ttft_ms["p99"], r.itl_ms["p99"], r.failed,
                   r.mean_token_usage, r.mean_queue_reqs, r.peak_queue_reqs, r.retractions,
                   r.duration_s, r.completed)


@dataclass
class Trial:
    config: dict  # the searched knobs' values (None: the engine's default)
    status: str  # ok | infeasible | n/a
    reason: str = ""  # why infeasible or not applicable
    measured: Measured | None = None
    seconds: float = 0.0  # wall time of the trial, start-up included
    how: str = "restart"  # live: the knobs were set on the running engine; restart: new Engine
    index: int = 0

    @property
    def score(self) -> float | None:
        """Output tok/s when feasible, else None (never ranked)."""
        return self.measured.output_throughput if self.status == OK else None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["score"] = self.score
        return _finite(d)


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return x


@dataclass
class Objective:
    """Maximize output throughput with p99 TTFT <= ``slo_ttft_ms`` and p99 ITL <= ``slo_itl_ms``
    (each when given)."""

    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None

    def judge(self, m: Measured) -> tuple[str, str]:
        """(status, reason) of a finished run."""
        if m.prefill_oom:
            return INFEASIBLE, "out of memory in prefill"
        if m.failed:
            return INFEASIBLE, f"{m.failed} request(s) failed"
        if m.completed == 0:
            return INFEASIBLE, "no request completed"
        misses = []
        if self.slo_ttft_ms is not None and not m.ttft_p99_ms <= self.slo_ttft_ms:
            misses.append(f"p99 TTFT {m.ttft_p99_ms:.1f} ms > {self.slo_ttft_ms:g} ms")
        if self.slo_itl_ms is not None and not m.itl_p99_ms <= self.slo_itl_ms:
            misses.append(f"p99 ITL {m.itl_p99_ms:.1f} ms > {self.slo_itl_ms:g} ms")
        if misses:
            return INFEASIBLE, "misses the SLO: " + ", ".join(misses)
        return OK, ""
