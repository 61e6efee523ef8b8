"""`engine bench serve|offline`: SGLang's bench_serving / bench_offline_throughput flags over
engine.bench (the library `engine tune` also measures with)."""

from __future__ import annotations

import math
import sys

import click

from engine_cli.options import EngineCommand, engine_options, given, split_options

DATASETS = ("random", "generated-shared-prefix", "shared-prefix", "sharegpt", "trace",
            "multi-turn")
WORKLOAD_FLAGS = ("dataset_name", "dataset_path", "num_prompts", "random_input_len",
                  "random_output_len", "random_range_ratio", "gsp_num_groups",
                  "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len",
                  "gsp_output_len", "mt_num_conversations", "mt_num_turns", "mt_turn_len",
                  "mt_output_len", "request_rate")
# the workload flags each dataset reads (given for another one: an error, not ignored)
APPLIES = {
    "random": {"num_prompts", "random_input_len", "random_output_len", "random_range_ratio",
               "request_rate"},
    "generated-shared-prefix": {"gsp_num_groups", "gsp_prompts_per_group",
                                "gsp_system_prompt_len", "gsp_question_len", "gsp_output_len",
                                "request_rate"},
    "sharegpt": {"num_prompts", "dataset_path", "request_rate"},
    "trace": {"dataset_path"},
    "multi-turn": {"mt_num_conversations", "mt_num_turns", "mt_turn_len", "mt_output_len",
                   "request_rate"},
}
OUTPUT_FLAGS = ("max_concurrency", "output_file", "json_out", "plot", "disable_tqdm")
BENCH_FLAGS = (*WORKLOAD_FLAGS, *OUTPUT_FLAGS)

_OPTIONS = [
    click.option("--dataset-name", default="random", type=click.Choice(DATASETS),
                 help="random: random token ids of --random-*-len; generated-shared-prefix "
                      "(shared-prefix): --gsp-num-groups system prompts, each shared by "
                      "--gsp-prompts-per-group questions; sharegpt: --dataset-path, a ShareGPT "
                      "JSON file; trace: --dataset-path, a JSONL trace (engine serve "
                      "--record-trace) replayed at its own arrival times; multi-turn: "
                      "--mt-num-conversations x --mt-num-turns, each turn appending to the "
                      "last."),
    click.option("--dataset-path", type=click.Path(exists=True, dir_okay=False),
                 help="The sharegpt or trace file."),
    click.option("--num-prompts", default=100, type=int, help="Requests (random, sharegpt)."),
    click.option("--random-input-len", default=256, type=int, help="Longest prompt (tokens)."),
    click.option("--random-output-len", default=128, type=int, help="Longest output (tokens)."),
    click.option("--random-range-ratio", default=0.0, type=float,
                 help="Lengths are uniform in [len * ratio, len]."),
    click.option("--gsp-num-groups", default=8, type=int, help="System prompts."),
    click.option("--gsp-prompts-per-group", default=8, type=int,
                 help="Questions per system prompt."),
    click.option("--gsp-system-prompt-len", default=256, type=int, help="Tokens."),
    click.option("--gsp-question-len", default=32, type=int, help="Tokens."),
    click.option("--gsp-output-len", default=64, type=int, help="Tokens."),
    click.option("--mt-num-conversations", default=8, type=click.IntRange(min=1),
                 help="multi-turn: conversations."),
    click.option("--mt-num-turns", default=4, type=click.IntRange(min=1),
                 help="multi-turn: turns per conversation, each appending to the last."),
    click.option("--mt-turn-len", default=128, type=click.IntRange(min=1),
                 help="multi-turn: new prompt tokens per turn."),
    click.option("--mt-output-len", default=64, type=click.IntRange(min=1),
                 help="multi-turn: output tokens per turn (the next turn's prompt holds that "
                      "many in its place)."),
    click.option("--request-rate", default=math.inf, type=float,
                 help="Requests per second, Poisson arrivals (seeded by --seed); inf: all at "
                      "once."),
    click.option("--max-concurrency", type=click.IntRange(min=1),
                 help="At most this many requests in flight.  [default: no limit]"),
    click.option("--output-file", type=click.Path(dir_okay=False),
                 help="Append the result as a JSON line."),
    click.option("--json", "json_out", is_flag=True,
                 help="Print the result as JSON instead of the table (no progress bar)."),
    click.option("--plot", type=click.Path(dir_okay=False),
                 help="Write a PNG of token usage, #queue-req and throughput over time."),
    click.option("--disable-tqdm", is_flag=True, help="No progress bar."),
]


def bench_options(f):
    for option in reversed(_OPTIONS):
        f = option(f)
    return f


@click.group("bench")
def bench_command():
    """Benchmark a server (serve) or the engine in this process (offline)."""


@bench_command.command("serve", context_settings={"show_default": True})
@bench_options
@click.option("--seed", default=1, type=int, help="Seeds the prompts and the arrivals.")
@click.option("--backend", default="sglang", type=click.Choice(["sglang", "openai"]),
              help="sglang: stream /generate; openai: stream /v1/completions.")
@click.option("--base-url", help="A running server.  [default: start `engine serve` with the "
                                 "flags after --, and stop it after]")
@click.option("--tokenizer", help="The prompts' tokenizer (model directory or GGUF).  "
                                  "[default: the model the server names in /v1/models]")
@click.argument("serve_flags", nargs=-1, type=click.UNPROCESSED)
def bench_serve(serve_flags, seed, backend, base_url, tokenizer, **kwargs):
    """Benchmark `engine serve` over HTTP: engine bench serve [OPTIONS] [-- SERVE FLAGS]."""
    if base_url and serve_flags:
        raise click.UsageError(f"engine serve flags ({' '.join(serve_flags)}) with --base-url: "
                               f"the server is already running; drop one.")
    target = base_url or list(serve_flags)
    _run(kwargs, seed, target, backend=backend, tokenizer=tokenizer)


@bench_command.command("offline", cls=EngineCommand, context_settings={"show_default": True})
@engine_options
@bench_options
def bench_offline(**kwargs):
    """Benchmark the engine in this process (no HTTP), with every engine flag; --seed seeds
    the workload too."""
    config, bench = split_options(kwargs, click.get_current_context().command.plugin_dests,
                                  BENCH_FLAGS)
    _run(bench, config["seed"], config)


def workload_from(ctx: click.Context, opts: dict, seed: int):
    """The Workload of the workload flags in ``opts``; a flag the dataset does not read is an
    error, not ignored."""
    from engine.bench import Workload

    name = "generated-shared-prefix" if opts["dataset_name"] == "shared-prefix" \
        else opts["dataset_name"]
    stray = [f"--{k.replace('_', '-')}" for k in WORKLOAD_FLAGS[1:]
             if k not in APPLIES[name] and given(ctx, k)]
    if stray:
        raise click.UsageError(f"{', '.join(stray)}: --dataset-name {name} does not read "
                               f"{'it' if len(stray) == 1 else 'them'}; drop "
                               f"{'it' if len(stray) == 1 else 'them'}.")
    chosen = {k: opts[k] for k in WORKLOAD_FLAGS if opts[k] is not None}
    return Workload(**{**chosen, "dataset_name": name, "seed": seed})


def _run(opts: dict, seed: int, target, **extra) -> None:
    from engine.bench import format_table, run_bench
    from engine.bench.plot import write_plot
    from engine.errors import EngineError

    workload = workload_from(click.get_current_context(), opts, seed)
    progress = not (opts["json_out"] or opts["disable_tqdm"]) and sys.stderr.isatty()
    try:
        result = run_bench(target, workload, max_concurrency=opts["max_concurrency"],
                           progress=progress, **extra)
    except EngineError as e:
        raise click.UsageError(str(e)) from None
    click.echo(result.to_json() if opts["json_out"] else format_table(result))
    if opts["output_file"]:
        with open(opts["output_file"], "a", encoding="utf-8") as f:
            f.write(result.to_json() + "\n")
    if opts["plot"]:
        write_plot(result, opts["plot"])
    if result.failed:
        raise click.ClickException(f"{result.failed} of {result.failed + result.completed} "
                                   f"requests failed (first errors above).")
