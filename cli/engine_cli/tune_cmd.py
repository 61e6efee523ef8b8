"""`engine tune`: search the tuning guides' knobs for the best output throughput under SLOs,
measuring each configuration with `engine bench offline`'s workload flags (engine.tune)."""

from __future__ import annotations

import json
import sys

import click

from engine_cli.bench_cmd import WORKLOAD_FLAGS, bench_options, workload_from
from engine_cli.options import EngineCommand, engine_options, given, split_options

# vLLM's flags fix the knob they spell (EngineConfig folds them into it)
VLLM_SPELLINGS = {"gpu_memory_utilization": "mem_fraction_static",
                  "max_num_seqs": "max_running_requests",
                  "max_num_batched_tokens": "chunked_prefill_size",
                  "enable_chunked_prefill": "chunked_prefill_size"}


@click.command("engine serve", cls=EngineCommand, add_help_option=False)
@engine_options
def fixed_flags(**kwargs):
    """Parses the engine flags after `--` exactly as `engine serve` would."""


def _workload_params() -> list[click.Parameter]:
    """bench's workload options (the same flags, help and defaults), --workload naming
    --dataset-name."""
    @bench_options
    def f(**kwargs):
        pass

    keep = (*WORKLOAD_FLAGS, "max_concurrency")
    params = [p for p in click.command()(f).params if p.name in keep]
    for p in params:
        if p.name == "dataset_name":
            p.opts.append("--workload")
    return params



def _parse_values(items: tuple[str, ...]) -> dict[str, list[str]]:
    from engine.tune.knobs import knob_name

    out = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not values.strip():
            raise click.UsageError(f"--values {item!r}: give NAME=V1,V2 (e.g. "
                                   f"schedule-conservativeness=0.3,0.7,1.3).")
        out[knob_name(name)] = [v for v in values.split(",") if v.strip()]
    return out


@click.command("tune", context_settings={"show_default": True})
@click.option("--slo-ttft-ms", type=click.FloatRange(min=0, min_open=True),
              help="Feasible only with p99 TTFT at or under this.  [default: no SLO]")
@click.option("--slo-itl-ms", type=click.FloatRange(min=0, min_open=True),
              help="Feasible only with p99 ITL at or under this.  [default: no SLO]")
@click.option("--budget-minutes", default=10.0, type=click.FloatRange(min=0, min_open=True),
              help="No trial starts that would end past this (the defaults always run).")
@click.option("--knobs", help="Comma-separated knobs to search, e.g. "
                              "schedule-conservativeness,chunked-prefill-size.  [default: every "
                              "knob not fixed after --]")
@click.option("--values", "values", multiple=True, metavar="NAME=V1,V2",
              help="A knob's candidates (repeatable); the default always joins them.  "
                   "[default: the tuner's own list per knob]")
@click.option("--seed", default=1, type=int, help="Seeds the workload.")
@click.option("--json", "json_out", is_flag=True,
              help="Print the result as JSON (the trial lines go to stderr).")
@click.argument("engine_flags", nargs=-1, type=click.UNPROCESSED)
def tune_command(engine_flags, slo_ttft_ms, slo_itl_ms, budget_minutes, knobs, values, seed,
                 json_out, **workload_opts):
    """Search the guides' knobs for the most output tok/s within the SLOs, measured offline
    (in this process, no HTTP) on the workload: engine tune [OPTIONS] [-- ENGINE FLAGS].

    The engine flags after -- are fixed (e.g. --model); the searched ones are changed live on
    the running engine where the scheduler allows, else by a new engine. Prints each trial,
    then the best `engine serve` command line and its measured gain over the defaults."""
    from engine.device import detect_device
    from engine.errors import EngineError
    from engine.tune import Evaluator, Objective, search, select
    from engine.tune.report import command, summary, trial_line

    ctx = click.get_current_context()
    workload = workload_from(ctx, workload_opts, seed)
    try:
        fctx = fixed_flags.make_context("engine serve", list(engine_flags))
    except click.UsageError as e:
        raise click.UsageError(f"the engine flags after --: {e.format_message()}") from None
    fixed = {n for n in fctx.params if given(fctx, n)}
    fixed |= {ours for theirs, ours in VLLM_SPELLINGS.items() if theirs in fixed}
    config, _ = split_options(fctx.params, fixed_flags.plugin_dests, ())
    try:
        kind = "cuda" if detect_device(config["device"]).is_cuda else "cpu"
        chosen = select(knobs.split(",") if knobs else None, _parse_values(values), fixed, kind)
        evaluator = Evaluator(config, workload.validate(),
                              max_concurrency=workload_opts["max_concurrency"])
        out = sys.stderr if json_out else sys.stdout
        try:
            res = search(chosen, evaluator, Objective(slo_ttft_ms, slo_itl_ms),
                         budget_s=budget_minutes * 60,
                         on_trial=lambda t: click.echo(trial_line(t, chosen), file=out))
        finally:
            evaluator.close()
    except EngineError as e:
        raise click.UsageError(str(e)) from None
    if json_out:
        d = res.as_dict()
        d["command"] = command(res.best.config, chosen, list(engine_flags)) if res.best else None
        click.echo(json.dumps(d))
    else:
        click.echo(summary(res, list(engine_flags)))
    if res.best is None:
        raise click.ClickException("no configuration tried was feasible.")


tune_command.params[:0] = _workload_params()


