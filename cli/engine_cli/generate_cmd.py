"""`engine generate`: the offline batch job of the guides, JSONL in and JSONL out."""

from __future__ import annotations

import logging

import click

from engine_cli.batch_job import read_jobs, run_job
from engine_cli.options import EngineCommand, engine_options, split_options

JOB_FLAGS = ("input", "output", "temperature", "top_p", "top_k", "min_p", "max_new_tokens",
             "min_new_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty",
             "stop", "ignore_eos", "log_level")
SAMPLING = JOB_FLAGS[2:-1]


@click.command("generate", cls=EngineCommand, context_settings={"show_default": True})
@engine_options
@click.option("--input", "input", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSONL: one request per line: {\"id\": ..., \"prompt\": \"...\" (or "
                   "\"input_ids\": [...]), \"sampling_params\": {...}} or just a JSON string.")
@click.option("--output", required=True, type=click.Path(dir_okay=False),
              help="JSONL results, appended as requests finish; existing ids are skipped "
                   "(resume).")
@click.option("--temperature", type=float, help="Default for lines without their own.")
@click.option("--top-p", type=float)
@click.option("--top-k", type=int)
@click.option("--min-p", type=float)
@click.option("--max-new-tokens", type=int)
@click.option("--min-new-tokens", type=int)
@click.option("--repetition-penalty", type=float)
@click.option("--frequency-penalty", type=float)
@click.option("--presence-penalty", type=float)
@click.option("--stop", multiple=True, help="A stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True, default=None)
@click.option("--log-level", default="warning",
              type=click.Choice(["debug", "info", "warning", "error", "critical"]))
def generate_command(**kwargs):
    """Run every request of an input JSONL file through the engine, offline."""
    from engine.engine import Engine
    from engine.errors import EngineError

    config, job = split_options(kwargs, click.get_current_context().command.plugin_dests,
                                JOB_FLAGS)
    logging.basicConfig(level=job["log_level"].upper(),
                        format="[%(asctime)s %(levelname)s] %(message)s")
    defaults = {k: job[k] for k in SAMPLING if job[k] not in (None, ())}
    if "stop" in defaults:
        defaults["stop"] = list(defaults["stop"])
    jobs = read_jobs(job["input"], defaults)
    try:
        engine = Engine(**config)
    except EngineError as e:
        raise click.UsageError(str(e)) from None
    s = run_job(engine, jobs, job["output"], echo=lambda m: click.echo(m, err=True))
    click.echo(
        f"done: {s['requests']} requests ({s['skipped']} already done), {s['output_tokens']} "
        f"output tokens in {s['seconds']:.1f} s = {s['throughput']:.1f} tok/s; token usage "
        f"peak {s['token_usage_peak']:.2f}; retractions {s['retractions']}", err=True)
