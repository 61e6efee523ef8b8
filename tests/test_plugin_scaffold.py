"""`engine plugins new NAME --kind KIND`: the packages it writes install offline, appear in
`engine plugins`, pass their own tests and serve; bad names and existing folders are refused;
`engine plugins [--json]` still lists."""

import json
import os
import subprocess
import sys
import sysconfig

import pytest
from click.testing import CliRunner

from engine_cli.main import cli

PYTHON = sys.executable
ENGINE = os.path.join(os.path.dirname(PYTHON), "engine")
KINDS = {"attention": "my_attention", "policy": "my_policy", "quant": "my_quant",
         "kv-dtype": "my_kv", "command": "my_command", "observer": "my_observer",
         "speculative": "my_drafter"}


def new(*args):
    return CliRunner().invoke(cli, ["plugins", "new", *args])


def test_plugins_without_a_subcommand_still_lists():
    table = CliRunner().invoke(cli, ["plugins"])
    assert table.exit_code == 0 and table.output.startswith("Device: ")
    assert "Schedule policies:" in table.output and "Commands:" not in table.output
    data = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).output)
    assert {"device", "plugins", "errors", "attention", "policies"} <= set(data)


@pytest.mark.parametrize("name", ["Shortest", "1st", "a__b", "a-b", "trailing_", "x" * 41,
                                  "with space"])
def test_a_bad_name_is_refused_saying_what_is_allowed(name, tmp_path):
    result = new(name, "--kind", "policy", "--dir", str(tmp_path))
    assert result.exit_code == 2
    assert (f"'{name}' is not a plugin name: use lowercase letters and digits, words joined by "
            f"single underscores, starting with a letter, at most 40 characters") in \
        result.output
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("name,kind,message", [
    ("lifo", "policy", "schedule policy 'lifo' is already registered by engine-example-plugin"),
    ("torch_native", "attention", "attention backend 'torch_native' is already registered by "
                                  "built-in"),
    ("serve", "command", "`engine serve` already exists"),
    ("policy_fcfs", "policy", "a distribution named engine-policy-fcfs is already installed"),
])
def test_a_name_that_is_taken_is_refused(name, kind, message, tmp_path):
    result = new(name, "--kind", kind, "--dir", str(tmp_path))
    assert result.exit_code == 2 and message in result.output.replace("\n", " ")
    assert not os.listdir(tmp_path)


def test_an_existing_folder_is_never_overwritten(tmp_path):
    (tmp_path / "engine-mine").mkdir()
    (tmp_path / "engine-mine" / "keep.txt").write_text("mine")
    result = new("mine", "--kind", "policy", "--dir", str(tmp_path))
    assert result.exit_code == 2 and "already exists" in result.output
    assert os.listdir(tmp_path / "engine-mine") == ["keep.txt"]


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """One package of each kind, written by the CLI, installed offline into one --target."""
    root = tmp_path_factory.mktemp("scaffold")
    for kind, name in KINDS.items():
        result = new(name, "--kind", kind, "--dir", str(root))
        assert result.exit_code == 0, result.output
        assert f"pip install -e {root / ('engine-' + name.replace('_', '-'))}" in result.output
    pkg = root / "engine-my-policy"
    written = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*") if p.is_file())
    target = root / "site"
    out = subprocess.run([PYTHON, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                          "--no-build-isolation", "--target", str(target),
                          *[str(root / f"engine-{n.replace('_', '-')}") for n in KINDS.values()]],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(target), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return root, env, written


def test_written_files(packages):
    root, _, written = packages
    pkg = root / "engine-my-policy"
    assert written == [
        "README.md", "engine_my_policy/__init__.py", "pyproject.toml", "tests/test_my_policy.py"]
    pyproject = (pkg / "pyproject.toml").read_text()
    assert 'build-backend = "setuptools.build_meta"' in pyproject
    assert '[project.entry-points.engine]\nmy_policy = "engine_my_policy"' in pyproject
    from engine.hookspecs import ENGINE_HOOKS_VERSION

    assert (f'ENGINE_HOOKS_VERSION = "{ENGINE_HOOKS_VERSION}"'
            in (pkg / "engine_my_policy" / "__init__.py").read_text())


def test_installed_packages_appear_in_engine_plugins_and_the_cli(packages):
    _, env, _ = packages
    out = subprocess.run([ENGINE, "plugins", "--json"], capture_output=True, text=True, env=env,
                         timeout=120)
    data = json.loads(out.stdout)
    dists = {p["dist"]: p for p in data["plugins"]}
    for kind, name in KINDS.items():
        assert f"engine-{name.replace('_', '-')}" in dists, kind
    assert not [e for e in data["errors"] if e["dist"].startswith("engine-my-")]
    for key, name in [("attention", "my_attention"), ("policies", "my_policy"),
                      ("quantization", "my_quant"), ("kv_dtypes", "my_kv"),
                      ("speculative", "my_drafter")]:
        row = next(r for r in data[key] if r["name"] == name)
        assert row["available"] and row["dist"] == f"engine-{name.replace('_', '-')}"
    assert dists["engine-my-observer"]["hooks"] == ["engine_started", "step_finished"]
    out = subprocess.run([ENGINE, "my-command", "--json"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["hooks_version"]


def test_the_generated_tests_pass(packages):
    root, env, _ = packages
    tests = [str(root / f"engine-{n.replace('_', '-')}" / "tests") for n in KINDS.values()]
    out = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                          str(root), *tests], capture_output=True, text=True, env=env, cwd=root,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "10 passed" in out.stdout


def test_pip_install_e_then_serve_with_the_new_policy(tmp_path, tiny_model_factory):
    """The README's three commands, in a throwaway venv that sees this one's packages."""
    assert new("short_first", "--kind", "policy", "--dir", str(tmp_path)).exit_code == 0
    base = subprocess.run([PYTHON, "-c", "import sys; print(sys.base_prefix)"],
                          capture_output=True, text=True).stdout.strip()
    venv = tmp_path / "venv"
    subprocess.run([os.path.join(base, "bin", "python3"), "-m", "venv", "--without-pip",
                    str(venv)], check=True, timeout=120)
    vpy = str(venv / "bin" / "python")
    site = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                      "['purelib'])"], capture_output=True, text=True).stdout
    ours = sysconfig.get_paths()["purelib"]
    with open(os.path.join(site.strip(), "engine_dev.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({ours!r})\n")
    out = subprocess.run([vpy, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                          "--no-build-isolation", "-e", str(tmp_path / "engine-short-first")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (tmp_path / "in.jsonl").write_text('{"prompt": "hello there"}\n{"prompt": "hi"}\n')
    engine = [vpy, "-c", "from engine_cli.main import cli; cli()"]
    out = subprocess.run([*engine, "generate", "--model", tiny_model_factory(), "--device", "cpu",
                          "--max-total-tokens", "256", "--schedule-policy", "short_first",
                          "--max-new-tokens", "2", "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(tmp_path / "out.jsonl")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
