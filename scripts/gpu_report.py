"""The GPU check's bookkeeping (scripts/gpu_check.sh calls it): the machine's facts, one record
per step, and the one-page gpu-report.md with gpu-results.json.

    python scripts/gpu_report.py env    --work DIR     # prints 1 if CUDA is usable, else why not
    python scripts/gpu_report.py record --work DIR --id ID --title T --rc RC --seconds S
                                        --timeout T [--parse pytest|cuda_graphs|kit]
    python scripts/gpu_report.py skip   --work DIR --id ID --title T --reason R
    python scripts/gpu_report.py note   --work DIR --id ID --status S --reason R
    python scripts/gpu_report.py report --work DIR --out DIR [--mode gpu|dry-run]

A step may leave ``DIR/ID.json`` ({"status", "reason", "figures", ...}); its output is
``DIR/ID.log``. Standard library only, besides torch for ``env`` (when it imports).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ORDER = ["kit", "a", "b", "c", "d", "e"]
TITLES = {
    "kit": "install the kit (offline, over the machine's torch)",
    "a": "(a) pytest -m gpu (tests/ and plugins/), and the triton tests on the GPU",
    "b": "(b) engine vs HF greedy on CUDA, with and without CUDA graphs",
    "c": "(c) benchmarks/cuda_graphs.py, batch 1/32/128",
    "d": "(d) decode attention per backend vs torch_native",
    "e": "(e) offline throughput, Llama-3-8B shapes, bfloat16, random weights",
}


def _tail(path: Path, lines: int = 15) -> list[str]:
    if not path.is_file():
        return []
    text = path.read_text(errors="replace").splitlines()
    return [t[:200] for t in text[-lines:]]


def env(work: Path) -> int:
    facts = {"python": platform.python_version(), "when": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                        time.gmtime())}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
            facts["nvidia-smi"] = out or "no answer"
        except (OSError, subprocess.SubprocessError) as exc:
            facts["nvidia-smi"] = f"failed: {exc}"
    else:
        facts["nvidia-smi"] = "not found"
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_cuda"] = torch.version.cuda
        facts["cuda"] = bool(torch.cuda.is_available())
        if facts["cuda"]:
            p = torch.cuda.get_device_properties(0)
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["gpu_detail"] = (f"{p.total_memory / 2**30:.0f} GiB, compute capability "
                                   f"{p.major}.{p.minor}, {p.multi_processor_count} SMs")
    except Exception as exc:  # torch missing or broken: say so, the GPU steps skip
        facts["torch"] = f"import failed: {type(exc).__name__}: {exc}"
        facts["cuda"] = False
    try:
        import triton

        facts["triton"] = triton.__version__
    except Exception:
        facts["triton"] = "not importable"
    try:
        import transformers

        facts["transformers"] = transformers.__version__
    except Exception:
        facts["transformers"] = "not importable"
    (work / "env.json").write_text(json.dumps(facts, indent=1))
    print(1 if facts["cuda"] else f"torch {facts['torch']} sees none; nvidia-smi: "
                                  f"{facts['nvidia-smi']}")
    return 0


def _parse_pytest(work: Path, rec: dict) -> None:
    roots = []
    for xml in sorted(work.glob("a*.xml")):
        try:
            roots.append(ET.parse(xml).getroot())
        except ET.ParseError:
            pass
    if not roots:
        return
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed, skips = [], {}
    for case in (c for root in roots for c in root.iter("testcase")):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kids = {c.tag: c for c in case}
        if "failure" in kids or "error" in kids:
            key = "failed" if "failure" in kids else "errors"
            counts[key] += 1
            msg = (kids.get("failure") if "failure" in kids else kids["error"]).get("message", "")
            failed.append(f"{name}: {msg.strip().splitlines()[0][:160] if msg.strip() else ''}")
        elif "skipped" in kids:
            counts["skipped"] += 1
            why = kids["skipped"].get("message", "")[:120]
            skips[why] = skips.get(why, 0) + 1
        else:
            counts["passed"] += 1
    rec["figures"] = {k: v for k, v in counts.items()}
    rec["failed_tests"] = failed[:25]
    rec["skip_reasons"] = dict(sorted(skips.items(), key=lambda kv: -kv[1])[:8])
    if rec["status"] in ("timeout",):
        return
    if counts["failed"] or counts["errors"]:
        rec["status"] = "fail"
        rec["reason"] = f"{counts['failed']} failed, {counts['errors']} errors"
    elif counts["passed"]:
        rec["status"] = "pass"
        rec.pop("reason", None)
    else:
        rec["status"] = "skipped"
        rec["reason"] = "every selected test skipped: " + "; ".join(list(skips)[:3])


def _parse_cuda_graphs(work: Path, rec: dict) -> None:
    rows = []
    for line in _tail(work / "c.log", 200):
        m = re.match(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+|-)\s+([\d.]+|-)\s*$", line)
        if m:
            backend, bs, eager, graphs, ratio = m.groups()
            rows.append(f"{backend} batch {bs}: eager {eager} tok/s, graphs {graphs} tok/s "
                        f"({ratio}x)")
        elif re.match(r"^\S+\s+cuda graph", line):
            rows.append(line.strip())
    if rows:
        rec["figures"] = {f"row {i + 1}": r for i, r in enumerate(rows)}


def _parse_kit(work: Path, rec: dict) -> None:
    figures = {}
    for name in ("kit-verify", "kit-install", "kit-unmet"):
        path = work / f"{name}.json"
        if path.is_file():
            figures[name] = json.loads(path.read_text())
    problems = figures.get("kit-verify") or []
    inst = figures.get("kit-install") or {}
    unmet = figures.get("kit-unmet") or []
    summary = {}
    if "kit-install" in figures:
        summary["installed"] = len(inst.get("installed", []))
        summary["left to the machine (same or newer there)"] = [
            s.split(" (")[0] for s in inst.get("skipped", [])]
        summary["own wheels rebuilt (the tree changed since make gpu-kit)"] = inst.get(
            "rebuilt", [])
    if inst.get("failed"):
        summary["pip could not install"] = inst["failed"]
        problems = [*problems, f"pip could not install {', '.join(inst['failed'])}"]
    if problems:
        summary["kit problems"] = problems
    if unmet:
        summary["unmet requirements"] = unmet
    rec["figures"] = summary
    if "kit-install" in figures:
        rec["summary"] = (f"{summary['installed']} wheels installed, "
                          f"{len(inst.get('skipped', []))} left to the machine (same or newer "
                          f"there), {len(inst.get('rebuilt', []))} own rebuilt from the tree")
    if problems:
        rec["status"] = "fail"
        before = rec.get("reason", "")
        rec["reason"] = "; ".join(problems) + (
            f" ({before})" if before and not before.startswith("exit code") else "")
    elif rec["status"] == "pass" and "kit-install" not in figures:
        rec["status"] = "fail"
        rec["reason"] = "the kit was not installed"
    elif rec["status"] == "pass" and unmet:
        rec["reason"] = f"{len(unmet)} requirement(s) unmet (see figures)"


def record(args) -> int:
    work = Path(args.work)
    rec = {"id": args.id, "title": args.title, "seconds": round(float(args.seconds), 1),
           "timeout": int(args.timeout), "rc": int(args.rc)}
    own = work / f"{args.id}.json"
    data = {}
    if own.is_file():
        try:
            data = json.loads(own.read_text())
        except json.JSONDecodeError:
            data = {}
    if rec["rc"] in (124, 137):
        rec["status"] = "timeout"
        rec["reason"] = f"stopped at its {rec['timeout']} s limit"
    elif data.get("status"):
        rec["status"] = data["status"]
        if data.get("reason"):
            rec["reason"] = data["reason"]
    elif rec["rc"] == 0:
        rec["status"] = "pass"
    else:
        rec["status"] = "fail"
        rec["reason"] = f"exit code {rec['rc']}"
    for key in ("figures", "cases"):
        if key in data:
            rec[key] = data[key]
    if args.parse == "pytest":
        _parse_pytest(work, rec)
    elif args.parse == "cuda_graphs":
        _parse_cuda_graphs(work, rec)
    elif args.parse == "kit":
        _parse_kit(work, rec)
    if rec["status"] in ("fail", "timeout"):
        rec["log_tail"] = _tail(work / f"{args.id}.log")
    (work / f"{args.id}.result.json").write_text(json.dumps(rec, indent=1))
    print(f"[{args.id}] {rec['status']}{': ' + rec['reason'] if rec.get('reason') else ''} "
          f"({rec['seconds']} s)", flush=True)
    return 0


def skip(args) -> int:
    work = Path(args.work)
    rec = {"id": args.id, "title": args.title, "status": "skipped", "reason": args.reason,
           "seconds": 0}
    (work / f"{args.id}.result.json").write_text(json.dumps(rec, indent=1))
    print(f"[{args.id}] skipped: {args.reason}", flush=True)
    return 0


def _summary(rec: dict) -> str:
    """One line of figures for the table."""
    fig, sid = rec.get("figures") or {}, rec["id"]
    if rec.get("summary"):
        return rec["summary"]
    if sid == "e" and fig:
        sizes = sorted({int(m.group(1)) for k in fig
                        for m in [re.match(r"batch (\d+) ", k)] if m})
        parts = []
        for i, bs in enumerate(sizes):
            if i == 0:
                share = {m: fig.get(f"batch {bs} {m}: % of roofline") for m in ("graphs",
                                                                                "eager")}
                parts.append(f"batch {bs}: " + ", ".join(
                    f"{m} {fig.get(f'batch {bs} {m}: ms/step')} ms/step = {share[m]}% of "
                    f"the roofline" for m in ("graphs", "eager") if share[m] is not None)
                    + f" ({fig.get('batch 1 roofline (ms/step)', '?')} ms)")
            for m in ("graphs", "eager"):
                if i and f"batch {bs} {m}: tok/s" in fig:
                    parts.append(f"batch {bs} {m}: {fig[f'batch {bs} {m}: tok/s']} tok/s")
        return "; ".join(parts)
    if sid == "b" and rec.get("cases"):
        f32 = [c for c in rec["cases"] if c.get("dtype") == "float32"
               and c.get("status") in ("pass", "fail")]
        good = [c for c in f32 if c["status"] == "pass"]
        bf16 = [f"{c['backend']} {c.get('matching_tokens')}" for c in rec["cases"]
                if c.get("dtype") == "bfloat16" and "matching_tokens" in c]
        return (f"float32: {len(good)} of {len(f32)} runs equal HF's greedy tokens"
                + (f"; bfloat16 tokens equal to HF's: {', '.join(bf16)}" if bf16 else ""))
    if sid == "d" and rec.get("cases"):
        return "; ".join(f"{c['backend']}: " + (f"{c['speed-up']}x torch_native"
                                               if "speed-up" in c else c["status"])
                         for c in rec["cases"])
    if sid == "c" and fig:
        return "; ".join(list(fig.values())[:3])
    return ""


def note(args) -> int:
    """A step's own record (DIR/ID.json), for a step that is a shell command."""
    (Path(args.work) / f"{args.id}.json").write_text(json.dumps(
        {"status": args.status, "reason": args.reason}))
    return 0


def _fmt(value) -> str:
    if isinstance(value, list):
        return "; ".join(str(v) for v in value) if value else "none"
    return str(value)


def report(args) -> int:
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    facts = json.loads((work / "env.json").read_text()) if (work / "env.json").is_file() else {}
    steps = {}
    for path in sorted(work.glob("*.result.json")):
        rec = json.loads(path.read_text())
        steps[rec["id"]] = rec
    manifest = {}
    if args.kit and (Path(args.kit) / "MANIFEST.json").is_file():
        manifest = json.loads((Path(args.kit) / "MANIFEST.json").read_text())
    gpu = facts.get("gpu") or "no CUDA device"
    lines = [f"# GPU check: {gpu}", "",
             f"{facts.get('when', '')}, mode **{args.mode}**. nvidia-smi: "
             f"{facts.get('nvidia-smi', '?')}. torch {facts.get('torch', '?')} (CUDA "
             f"{facts.get('torch_cuda')}), triton {facts.get('triton', '?')}, transformers "
             f"{facts.get('transformers', '?')}, Python {facts.get('python', '?')}."
             + (f" {facts['gpu_detail']}." if facts.get("gpu_detail") else "")]
    if manifest:
        lines.append(f"Kit: {len(manifest['wheels'])} wheels, "
                     f"{manifest['total_bytes'] / 2**20:.2f} MiB of the "
                     f"{manifest['cap_bytes'] / 2**20:.0f} MiB cap, built {manifest['built']}.")
    lines += ["", "| step | status | s | summary |", "|---|---|---|---|"]
    for sid in ORDER + sorted(set(steps) - set(ORDER)):
        rec = steps.get(sid)
        if rec is None:
            if "part" not in args.mode:
                lines.append(f"| {TITLES.get(sid, sid)} | not run | | not in this part |")
            continue
        summary = "; ".join(filter(None, (rec.get("reason", ""), _summary(rec))))
        fig = rec.get("figures") or {}
        if sid == "a" and fig:
            summary = (f"{fig.get('passed', 0)} passed, {fig.get('failed', 0)} failed, "
                       f"{fig.get('errors', 0)} errors, {fig.get('skipped', 0)} skipped"
                       + (f"; {summary}" if summary and rec["status"] != "fail" else ""))
        summary = summary.replace("|", "/").replace("\n", " ")[:400]
        lines.append(f"| {rec.get('title', TITLES.get(sid, sid))} | **{rec['status']}** | "
                     f"{rec.get('seconds', '')} | {summary} |")
    for sid in ("e", "c", "d", "b", "kit"):
        rec = steps.get(sid)
        if not rec or not rec.get("figures"):
            continue
        lines += ["", f"## {TITLES.get(sid, sid)}", ""]
        lines += [f"- {k}: {_fmt(v)}" for k, v in rec["figures"].items()]
        for case in rec.get("cases", []):
            if case.get("status") == "skipped":
                lines.append(f"- {case.get('backend')}: skipped ({case.get('reason')})")
    rec = steps.get("a")
    if rec and (rec.get("failed_tests") or rec.get("skip_reasons")):
        lines += ["", f"## {TITLES['a']}", ""]
        lines += [f"- FAILED {t}" for t in rec.get("failed_tests", [])]
        lines += [f"- skipped ×{n}: {why}" for why, n in rec.get("skip_reasons", {}).items()]
    tails = [(sid, steps[sid]) for sid in ORDER if sid in steps and steps[sid].get("log_tail")]
    if tails:
        lines += ["", "## Last lines of failing steps", ""]
        for sid, rec in tails:
            lines += [f"{TITLES.get(sid, sid)}:", "```", *rec["log_tail"], "```"]
    if manifest.get("left_out"):
        lines += ["", "## Left out of the kit", ""]
        lines += [f"- {e['name']} {e['version']} ({e['size']}): {e['why']}; skips "
                  f"{e['skips']}" for e in manifest["left_out"]]
    lines += ["", "Full output: gpu-check.log; every figure: gpu-results.json."]
    (out / "gpu-report.md").write_text("\n".join(lines) + "\n")
    (out / "gpu-results.json").write_text(json.dumps(
        {"mode": args.mode, "machine": facts, "steps": steps,
         "kit": {k: manifest.get(k) for k in ("built", "total_bytes", "cap_bytes", "left_out")}},
        indent=1) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["env", "record", "skip", "note", "report"])
    ap.add_argument("--work", required=True)
    ap.add_argument("--id")
    ap.add_argument("--title", default="")
    ap.add_argument("--rc", default="0")
    ap.add_argument("--seconds", default="0")
    ap.add_argument("--timeout", default="0")
    ap.add_argument("--parse", choices=["pytest", "cuda_graphs", "kit"])
    ap.add_argument("--reason", default="")
    ap.add_argument("--out")
    ap.add_argument("--kit")
    ap.add_argument("--mode", default="gpu")
    ap.add_argument("--status", default="fail")
    args = ap.parse_args()
    if args.command == "env":
        return env(Path(args.work))
    if args.command == "record":
        return record(args)
    if args.command == "skip":
        return skip(args)
    if args.command == "note":
        return note(args)
    return report(args)


if __name__ == "__main__":
    sys.exit(main())
