"""The GPU kit (`make gpu-kit`, scripts/gpu_kit.py) and the GPU check's dry run
(scripts/gpu_check.sh --dry-run): the kit's own wheels, its manifest and 60 MiB cap, the offline
install into a folder, the report with every GPU step skipped for a reason, and the GPU steps'
scripts run on the CPU (their code paths, not their figures). The full kit, which downloads
third-party wheels from PyPI, is built under the slow mark."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
MiB = 1 << 20


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_kit = load("gpu_kit")
gpu_report = load("gpu_report")


def run(*args, env=None, timeout=240):
    return subprocess.run([*map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def own_kit(tmp_path_factory):
    """A kit of this repository's own wheels only (no download): what CI can always build."""
    kit = tmp_path_factory.mktemp("kit") / ".gpu-kit"
    proc = run(sys.executable, SCRIPTS / "gpu_kit.py", "build", "--own-only", "--kit", kit)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return kit


def own_projects():
    return [p.relative_to(ROOT).as_posix() for p in gpu_kit.own_projects()]


def test_own_kit_manifest_lists_every_distribution_within_the_cap(own_kit):
    m = json.loads((own_kit / "MANIFEST.json").read_text())
    own = {w["project"]: w for w in m["wheels"] if w["kind"] == "own"}
    assert set(own) == set(own_projects()) >= {"core", "cli", "testing", "plugins/attention_triton",
                                               "plugins/attention_fa3",
                                               "plugins/attention_flashinfer"}
    assert own["core"]["name"] == "engine-core" and own["cli"]["name"] == "engine-cli"
    assert m["total_bytes"] == sum(p.stat().st_size for p in own_kit.glob("*.whl"))
    assert m["total_bytes"] <= m["cap_bytes"] == 60 * MiB
    left = {e["name"]: e for e in m["left_out"]}
    # the big, torch-bound kernels are named with a size and the part of the check they skip
    assert "510.8 MiB" in left["sgl-kernel"]["size"] and "fa3" in left["sgl-kernel"]["skips"]
    assert "MiB" in left["flashinfer-python"]["size"]
    assert "flashinfer" in left["flashinfer-python"]["skips"]
    # an own-only kit says that it carries no third-party wheel
    assert "own-only" in left["pydantic"]["why"]
    text = (own_kit / "MANIFEST.txt").read_text()
    assert "engine_core-0.1.0-py3-none-any.whl" in text and "sgl-kernel" in text
    assert gpu_kit.verify(own_kit) == []
    assert (own_kit / ".gitignore").read_text() == "*\n"


def test_own_wheels_are_complete_valid_and_reproducible(own_kit, tmp_path):
    whl = own_kit / "engine_cli-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl) as zf:
        names = zf.namelist()
        info = "engine_cli-0.1.0.dist-info"
        assert zf.read(f"{info}/entry_points.txt").decode().startswith(
            "[console_scripts]\nengine = engine_cli.main:cli\n")
        meta = zf.read(f"{info}/METADATA").decode()
        assert "Requires-Dist: click>=8.1" in meta and 'extra == "bench"' in meta
        for line in zf.read(f"{info}/RECORD").decode().splitlines():
            name, digest, size = line.split(",")
            if name.endswith("RECORD"):
                continue
            data = zf.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert digest == "sha256=" + want.decode() and int(size) == len(data)
    # every file of the package is in it (templates included), no bytecode
    pkg = ROOT / "cli" / "engine_cli"
    files = {p.relative_to(ROOT / "cli").as_posix() for p in pkg.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert files <= set(names) and not any(n.endswith(".pyc") for n in names)
    with zipfile.ZipFile(own_kit / "engine_attention_fa3-0.1.0-py3-none-any.whl") as zf:
        eps = zf.read("engine_attention_fa3-0.1.0.dist-info/entry_points.txt").decode()
    assert "[engine]\nattention_fa3 = engine_attention_fa3\n" in eps
    again = gpu_kit.build_own_wheel(ROOT / "cli", tmp_path)
    assert again.read_bytes() == whl.read_bytes()


def test_verify_catches_a_changed_wheel_an_extra_file_and_the_cap(own_kit, tmp_path):
    import shutil

    kit = tmp_path / "kit"
    shutil.copytree(own_kit, kit)
    assert gpu_kit.verify(kit) == []
    (kit / "engine_policy_fcfs-0.1.0-py3-none-any.whl").write_bytes(b"not a wheel")
    (kit / "stray-1.0-cp311-cp311-win_amd64.whl").write_bytes(b"x")
    m = json.loads((kit / "MANIFEST.json").read_text())
    m["cap_bytes"] = 1000
    (kit / "MANIFEST.json").write_text(json.dumps(m))
    problems = "\n".join(gpu_kit.verify(kit))
    assert "engine_policy_fcfs-0.1.0-py3-none-any.whl: size or sha256 differs" in problems
    assert "stray-1.0-cp311-cp311-win_amd64.whl: in the kit, not in the manifest" in problems
    assert "no tag for cp312 manylinux x86_64" in problems
    assert "over the 0 MiB cap" in problems


def test_requirements_are_checked_against_the_kit_and_the_machine():
    env = gpu_kit.target_env("3.12")
    reqs = {"x": ["numpy", "triton; platform_machine == 'x86_64'", "torch>=2.4",
                  "typing-extensions>=4.9; python_version < '3.12'", "missing-pkg",
                  "matplotlib; extra == 'bench'", "pydantic-core==2.50.5"]}
    unmet = gpu_kit.unmet_requirements({"pydantic-core": "2.50.5"}, reqs,
                                       {"numpy": None, "triton": "3.6.0", "torch": "2.3.1"}, env)
    assert unmet == ["x: torch>=2.4 (found 2.3.1)",
                     "x: missing-pkg (not in the kit nor on the machine)"]
    assert gpu_kit.fits_target("cp39-abi3-manylinux_2_31_x86_64")
    assert gpu_kit.fits_target("cp312-cp312-manylinux_2_17_x86_64")
    assert gpu_kit.fits_target("py3-none-any")
    assert not gpu_kit.fits_target("cp311-cp311-manylinux_2_17_x86_64")
    assert not gpu_kit.fits_target("cp312-cp312-manylinux_2_17_aarch64")


def test_the_engine_core_requirement_takes_the_gpu_machines_torch():
    """torch==2.13.0 is what `make install` puts on a CPU machine; no distribution pins it, and
    the lent machine's 2.11 satisfies every torch requirement."""
    _, Requirement, _, Version = gpu_kit._packaging()
    for proj in gpu_kit.own_projects():
        project, _ = gpu_kit._project(proj)
        for line in project.get("dependencies", []):
            req = Requirement(line)
            if req.name == "torch":
                assert req.specifier.contains(Version("2.11.0")), (proj, line)
                assert req.specifier.contains(Version("2.13.0")), (proj, line)


def test_dry_run_checks_the_kit_installs_it_and_reports_every_gpu_step_skipped(own_kit,
                                                                                tmp_path):
    out = tmp_path / "out"
    proc = run("bash", SCRIPTS / "gpu_check.sh", "--dry-run", out,
               env={"PYTHON": sys.executable, "GPU_KIT": str(own_kit)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.log", "gpu-report.md",
                                                    "gpu-results.json"]
    results = json.loads((out / "gpu-results.json").read_text())
    steps = results["steps"]
    assert steps["kit"]["status"] == "pass", steps["kit"]
    assert steps["kit"]["figures"]["installed"] == len(own_projects())
    for sid in "abcde":
        assert steps[sid]["status"] == "skipped"
        assert steps[sid]["reason"].startswith(("no CUDA device present", "dry run"))
    report = (out / "gpu-report.md").read_text()
    assert "mode **dry-run**" in report and "## Left out of the kit" in report
    assert "(e) offline throughput, Llama-3-8B shapes" in report
    assert report.count("**skipped**") == 5
    assert len(report.splitlines()) < 60  # one page


def test_dry_run_fails_without_a_kit(tmp_path):
    proc = run("bash", SCRIPTS / "gpu_check.sh", "--dry-run", tmp_path / "out",
               env={"PYTHON": sys.executable, "GPU_KIT": str(tmp_path / "none")})
    assert proc.returncode == 1
    report = (tmp_path / "out" / "gpu-report.md").read_text()
    assert "install the kit (offline, over the machine's torch) | **fail**" in report


def test_report_reads_pytest_and_cuda_graphs_output(tmp_path):
    (tmp_path / "a1.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="ok"/>'
        '<testcase classname="t" name="bad"><failure message="assert 1 == 2">x</failure>'
        '</testcase><testcase classname="t" name="s"><skipped message="needs sgl-kernel"/>'
        '</testcase></testsuite></testsuites>')
    (tmp_path / "a.log").write_text("1 failed, 1 passed, 1 skipped\n")
    (tmp_path / "c.log").write_text(
        "NVIDIA H100, model random Llama, dtype bfloat16\n"
        "backend        batch   eager tok/s  graphs tok/s   ratio\n"
        "triton             1         250.0         900.5    3.60\n"
        "torch_native   cuda graph: off (attention backend torch_native cannot run ...)\n"
        "torch_native       1         240.0             -       -\n")
    (tmp_path / "env.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3"}))

    def record(sid, rc, parse):
        ns = type("A", (), dict(work=str(tmp_path), id=sid, title=gpu_report.TITLES[sid],
                                rc=str(rc), seconds="3", timeout="100", parse=parse))
        gpu_report.record(ns)
        return json.loads((tmp_path / f"{sid}.result.json").read_text())

    a = record("a", 1, "pytest")
    assert a["status"] == "fail" and a["figures"]["passed"] == 1
    assert a["failed_tests"] == ["t::bad: assert 1 == 2"]
    assert a["skip_reasons"] == {"needs sgl-kernel": 1}
    c = record("c", 0, "cuda_graphs")
    assert c["status"] == "pass"
    assert list(c["figures"].values())[0] == ("triton batch 1: eager 250.0 tok/s, graphs 900.5 "
                                              "tok/s (3.60x)")
    assert record("e", 124, None)["status"] == "timeout"
    ns = type("A", (), dict(work=str(tmp_path), out=str(tmp_path / "o"), kit=None, mode="gpu"))
    gpu_report.report(ns)
    text = (tmp_path / "o" / "gpu-report.md").read_text()
    assert text.startswith("# GPU check: NVIDIA H100 80GB HBM3")
    assert "FAILED t::bad" in text and "stopped at its 100 s limit" in text


@pytest.mark.parametrize("script,args", [
    ("gpu_throughput.py", ["--preset", "tiny", "--batch-sizes", "1,2", "--steps", "2",
                           "--prompt-len", "8"]),
    ("gpu_attention.py", ["--backends", "cpu", "--batch", "2", "--layers", "1", "--steps", "1",
                          "--max-ctx", "64"]),
    ("gpu_greedy.py", ["--new-tokens", "4", "--backends", "torch_native"]),
])
def test_gpu_step_scripts_run_on_the_cpu(tmp_path, script, args):
    """Each GPU step's script through the same engine calls on the CPU (--device cpu), and a
    'skipped' record where CUDA is asked for and absent."""
    out = tmp_path / "r.json"
    proc = run(sys.executable, SCRIPTS / script, "--json", out, "--device", "cpu", *args,
               env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["status"] == "pass", result
    if script == "gpu_throughput.py":
        # the model was built from the random in-memory checkpoint, not read from disk
        assert result["weight_bytes"] > 32000 * 256 * 2 * 2
        assert "batch 2 eager: tok/s" in result["figures"]
        import torch

        if not torch.cuda.is_available():  # the step's record on a machine without CUDA
            proc = run(sys.executable, SCRIPTS / script, "--json", out)
            assert proc.returncode == 0 and json.loads(out.read_text())["status"] == "skipped"
    if script == "gpu_greedy.py":
        figures = result["figures"]
        assert figures == {"llama torch_native float32": "12/12",
                           "llama torch_native bfloat16": figures["llama torch_native bfloat16"],
                           "llama+NGRAM torch_native float32 graphs": "12/12",
                           "Qwen3MoeForCausalLM torch_native float32": "12/12",
                           "Qwen3MoeForCausalLM+graphs torch_native float32 graphs": "12/12",
                           "DeepseekV3ForCausalLM torch_native float32": "12/12",
                           "DeepseekV3ForCausalLM+graphs torch_native float32 graphs": "12/12"}


@pytest.mark.slow
def test_make_gpu_kit_builds_the_full_kit_within_60_mib(tmp_path):
    """`make gpu-kit` as a user runs it: downloads the third-party wheels (PyPI), checks every
    requirement against the machine's package list, stays within the cap; then the dry run."""
    kit = tmp_path / ".gpu-kit"
    proc = run("make", "gpu-kit", f"GPU_KIT={kit}", f"PY={sys.executable}", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = json.loads((kit / "MANIFEST.json").read_text())
    assert m["unmet_requirements"] == [] and gpu_kit.verify(kit) == []
    assert m["total_bytes"] <= 60 * MiB
    names = [gpu_kit.canon(w["name"]) for w in m["wheels"]]
    assert len(names) == len(set(names))
    carried = {gpu_kit.canon(e["name"]) for e in gpu_kit.load_config()["carry"]}
    assert carried <= set(names)
    machine = {gpu_kit.canon(n) for n in gpu_kit.load_config()["machine"]["packages"]}
    # nothing the machine has is carried, except typing-extensions (pydantic-core needs >=4.16)
    assert carried & machine == {"typing-extensions"}
    out = tmp_path / "out"
    proc = run("bash", SCRIPTS / "gpu_check.sh", "--dry-run", out,
               env={"PYTHON": sys.executable, "GPU_KIT": str(kit)})
    assert proc.returncode == 0, proc.stdout[-3000:]
    steps = json.loads((out / "gpu-results.json").read_text())["steps"]
    assert steps["kit"]["figures"]["installed"] == len(names)
