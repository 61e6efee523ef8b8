"""The `engine` command line: help, plugins table, plugin-contributed subcommands."""

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from engine_cli.main import cli

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_the_example_plugin_is_not_installed():
    """`make install` users never get the tests' plugin: outside the tests' sys.path it is
    gone (the suite finds it through tests/fixtures/example_plugin's dist-info)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    data = json.loads(subprocess.run([ENGINE, "plugins", "--json"], capture_output=True,
                                     text=True, env=env, timeout=120).stdout)
    dists = {p["dist"] for p in data["plugins"]}
    assert "engine-policy-lpm" in dists and "engine-example-plugin" not in dists
    assert "example_plugin" not in open(os.path.join(ROOT, "requirements-dev.txt")).read()


def test_slow_tests_run_only_when_asked_for(tmp_path):
    """The `slow` marker: deselected by the project's pytest options, selected by `-m slow`."""
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n\n@pytest.mark.slow\ndef test_long():\n    pass\n\n"
        "def test_short():\n    pass\n")
    config = os.path.join(ROOT, "pyproject.toml")

    def run(*args):
        out = subprocess.run([sys.executable, "-m", "pytest", "-c", config, "-p",
                              "no:cacheprovider", "--rootdir", str(tmp_path), *args,
                              str(tmp_path / "test_marked.py")], capture_output=True, text=True,
                             timeout=120)
        return out.stdout.strip().splitlines()[-1]

    assert "1 passed, 1 deselected" in run()
    assert "1 passed, 1 deselected" in run("-m", "slow")
