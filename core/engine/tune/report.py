"""What `engine tune` prints: a line per trial, the best command line, its gain, the table."""

from __future__ import annotations

import shlex

from engine.tune.knobs import Knob
from engine.tune.search import TuneResult
from engine.tune.trial import Trial


def flags(config: dict, knobs: list[Knob]) -> list[str]:
    """The `engine serve` flags that set ``config`` where it differs from the defaults."""
    out = []
    for k in knobs:
        value = config[k.name]
        if value == k.default or value is None:
            continue
        if isinstance(value, bool):
            out += [k.flag] if value else []
        else:
            out += [k.flag, str(value)]
    return out


def command(config: dict, knobs: list[Knob], fixed_args: list[str]) -> str:
    return shlex.join(["engine", "serve", *fixed_args, *flags(config, knobs)])


def _opt(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def trial_line(t: Trial, knobs: list[Knob]) -> str:
    diff = " ".join(flags(t.config, knobs)) or "(defaults)"
    head = f"trial {t.index:>2}  {t.how:<7} {t.seconds:6.1f} s  {diff}"
    m = t.measured
    if m is None or t.status == "n/a":
        return f"{head}: not applicable here: {t.reason}"
    nums = (f"{m.output_throughput:.1f} tok/s, p99 TTFT {m.ttft_p99_ms:.1f} ms, p99 ITL "
            f"{m.itl_p99_ms:.1f} ms, usage {_opt(m.mean_token_usage, '.2f')}, #queue-req "
            f"{_opt(m.mean_queue_reqs, '.1f')}, retractions {_opt(m.retractions, 'd')}")
    return f"{head}: {nums}" + (f"  [{t.status}: {t.reason}]" if t.reason else "")


def summary(res: TuneResult, fixed_args: list[str], what: str = "search") -> str:
    lines = [*(f"note: {n}" for n in res.notes)]
    live = sum(t.how == "live" for t in res.trials)
    lines.append(f"{what}: {len(res.trials)} trials ({live} live, {len(res.trials) - live} "
                 f"with a restart) in {res.seconds:.1f} s")
    best, base = res.best, res.defaults
    if best is None:
        lines.append("best: none: no configuration was feasible (see the reasons above)")
        return "\n".join(lines)
    lines.append(f"best: {command(best.config, res.knobs, fixed_args)}")
    if base.status != "ok":
        lines.append(f"the defaults are {base.status}: {base.reason}")
    if res.gain is not None:
        lines.append(f"measured gain over the defaults: {res.gain:.2f}x "
                     f"({best.measured.output_throughput:.1f} vs "
                     f"{base.measured.output_throughput:.1f} output tok/s, trial {best.index} vs "
                     f"trial 0)")
    lines.append(table(res))
    return "\n".join(lines)


def table(res: TuneResult) -> str:
    names = [k.name for k in res.knobs]
    head = ["#", "how", "s", *(n.replace("_", "-") for n in names), "tok/s", "p99 TTFT",
            "p99 ITL", "status"]
    rows = [head]
    for t in res.trials:
        m = t.measured
        rows.append([str(t.index), t.how, f"{t.seconds:.1f}",
                     *("default" if t.config[n] is None else str(t.config[n]) for n in names),
                     f"{m.output_throughput:.1f}" if m else "-",
                     f"{m.ttft_p99_ms:.1f}" if m else "-", f"{m.itl_p99_ms:.1f}" if m else "-",
                     t.status])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
