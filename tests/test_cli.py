"""The `engine` command line: help, plugins table, plugin-contributed subcommands."""

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from engine_cli.main import cli

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")


def test_help_lists_subcommands_including_a_plugins_one():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "plugins" in result.output and "example-hello" in result.output


def test_plugin_subcommand_runs():
    result = CliRunner().invoke(cli, ["example-hello", "ada"])
    assert result.output.strip() == "hello ada from engine-example-plugin"


def test_plugins_table_shows_availability_and_reasons():
    result = CliRunner().invoke(cli, ["plugins"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "engine-policy-lpm" in out and "engine-example-plugin" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert lines["torch_native"].rstrip().endswith("yes")
    assert lines["cpu"].rstrip().endswith("yes")  # its kernel builds here
    assert "no — needs an NVIDIA GPU" in lines["flashinfer"]
    assert lines["fp8"].rstrip().endswith("yes")  # the dequantize path runs on any device


def test_plugins_json_is_machine_readable():
    data = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).output)
    dists = {p["dist"] for p in data["plugins"]}
    assert {"engine-attention-fa3", "engine-attention-flashinfer", "engine-quant-fp8",
            "engine-policy-lpm", "engine-policy-fcfs", "engine-example-plugin"} <= dists
    lifo = next(p for p in data["policies"] if p["name"] == "lifo")
    assert lifo["dist"] == "engine-example-plugin" and lifo["available"]


def test_example_plugin_disappears_when_not_loaded():
    env = {**os.environ, "ENGINE_DISABLE_PLUGINS": "engine-example-plugin"}
    out = subprocess.run([ENGINE, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "plugins" in out.stdout
    assert "example-hello" not in out.stdout
    data = json.loads(subprocess.run([ENGINE, "plugins", "--json"], capture_output=True,
                                     text=True, env=env, timeout=120).stdout)
    assert "engine-example-plugin" not in {p["dist"] for p in data["plugins"]}
