"""`engine`: the click group; plugins add subcommands through register_commands(cli)."""

from __future__ import annotations

import click

from engine.plugins import load_plugins
from engine_cli.bench_cmd import bench_command
from engine_cli.doctor_cmd import doctor_command
from engine_cli.generate_cmd import generate_command
from engine_cli.plugins_cmd import plugins_command
from engine_cli.serve_cmd import serve_command
from engine_cli.tune_cmd import tune_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="engine-core", prog_name="engine")
def cli():
    """engine: an LLM inference server with pluggable attention, quantization and scheduling."""


cli.add_command(plugins_command)
cli.add_command(serve_command)
cli.add_command(generate_command)
cli.add_command(doctor_command)
cli.add_command(bench_command)
cli.add_command(tune_command)

load_plugins().hook.register_commands(cli=cli)
