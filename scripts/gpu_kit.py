"""The GPU kit: wheels for a lent GPU machine (cp312, manylinux x86_64, its own torch), what the
machine lacks and nothing more, within a size cap; see scripts/gpu-kit.toml and docs/gpu.md
("GPU kit and check").

    python scripts/gpu_kit.py build   [--kit .gpu-kit] [--own-only] [--cache DIR]
    python scripts/gpu_kit.py verify  [--kit .gpu-kit]            # files vs manifest, the cap
    python scripts/gpu_kit.py install [--kit .gpu-kit] --target DIR [--dry-run]
    python scripts/gpu_kit.py unmet                               # requirements the env lacks

`build` writes this repository's own wheels (core, cli, testing, every plugins/*) with a small PEP 427
builder of its own (standard library only: no hatchling, no network, so the lent machine can
rebuild them too), downloads the third-party wheels of gpu-kit.toml once into a cache
(``$ENGINE_CACHE_DIR/gpu-kit``, else ~/.cache/engine/gpu-kit), checks that every requirement of
every wheel is met by the kit or the machine's package list, and writes MANIFEST.json and
MANIFEST.txt. Needs Python >= 3.11 (tomllib) and pip.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CONFIG = Path(__file__).resolve().parent / "gpu-kit.toml"
MiB = 1 << 20
ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # reproducible wheels: same tree, same bytes
SKIP_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".so", ".o")
# the hatch settings the builder understands; any other one fails the build loudly
KNOWN_WHEEL_KEYS = {"packages", "bypass-selection"}


def _packaging():
    try:
        from packaging.markers import Marker
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
        from packaging.version import Version
    except ModuleNotFoundError:
        from pip._vendor.packaging.markers import Marker
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name
        from pip._vendor.packaging.version import Version
    return Marker, Requirement, canonicalize_name, Version


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def load_config() -> dict:
    with open(CONFIG, "rb") as f:
        return tomllib.load(f)


def own_projects() -> list[Path]:
    """core, cli, the test kit (the GPU check's tests use it) and every plugin with a
    pyproject.toml (the meta-distribution has no code)."""
    dirs = [ROOT / "core", ROOT / "cli", ROOT / "testing"]
    dirs += sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))
    return dirs


# ---- this repository's own wheels -------------------------------------------------------------
def _project(proj: Path) -> tuple[dict, list[str]]:
    with open(proj / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)
    project = data["project"]
    if project.get("dynamic"):
        raise SystemExit(f"{proj}/pyproject.toml: dynamic fields {project['dynamic']} are not "
                         f"supported by scripts/gpu_kit.py's builder")
    hatch = data.get("tool", {}).get("hatch", {})
    wheel = hatch.get("build", {}).get("targets", {}).get("wheel", {})
    unknown = (set(wheel) - KNOWN_WHEEL_KEYS) | (set(hatch.get("build", {})) - {"targets"}) | (
        set(hatch.get("build", {}).get("targets", {})) - {"wheel"})
    if unknown:
        raise SystemExit(f"{proj}/pyproject.toml: hatch settings {sorted(unknown)} are not "
                         f"supported by scripts/gpu_kit.py's builder; teach it them")
    packages = wheel.get("packages")
    if not packages:
        raise SystemExit(f"{proj}/pyproject.toml names no [tool.hatch.build.targets.wheel] "
                         f"packages")
    return project, packages


def _package_files(proj: Path, packages: list[str]) -> list[tuple[str, Path]]:
    """(path in the wheel, file) for every file of the packages, sorted."""
    out = []
    for pkg in packages:
        base = proj / pkg
        if not base.is_dir():
            raise SystemExit(f"{proj}: package folder {pkg} is missing")
        for path in base.rglob("*"):
            rel = path.relative_to(proj)
            if (path.is_dir() or SKIP_PARTS & set(rel.parts) or path.name.endswith(SKIP_SUFFIXES)
                    or any(p.endswith(".egg-info") for p in rel.parts)):
                continue
            out.append((rel.as_posix(), path))
    return sorted(out)


def source_hash(proj: Path) -> str:
    """What an own wheel is built from: pyproject.toml, the readme and every package file."""
    project, packages = _project(proj)
    h = hashlib.sha256()
    extra = [("pyproject.toml", proj / "pyproject.toml")]
    readme = project.get("readme")
    if isinstance(readme, str) and (proj / readme).is_file():
        extra.append((readme, proj / readme))
    for rel, path in extra + _package_files(proj, packages):
        h.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _metadata(project: dict, proj: Path) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}",
             f"Version: {project['version']}"]
    if project.get("description"):
        lines.append(f"Summary: {project['description']}")
    if project.get("requires-python"):
        lines.append(f"Requires-Python: {project['requires-python']}")
    for req in project.get("dependencies", []):
        lines.append(f"Requires-Dist: {req}")
    for extra, reqs in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        for req in reqs:
            marker = f'extra == "{extra}"'
            lines.append(f"Requires-Dist: {req}; {marker}" if ";" not in req else
                         f"Requires-Dist: {req.split(';')[0].strip()}; "
                         f"({req.split(';', 1)[1].strip()}) and {marker}")
    body = ""
    readme = project.get("readme")
    if isinstance(readme, str) and (proj / readme).is_file():
        lines.append("Description-Content-Type: text/markdown")
        body = "\n" + (proj / readme).read_text()
    return "\n".join(lines) + "\n" + body


def _entry_points(project: dict) -> str:
    groups = {}
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    groups.update(project.get("entry-points", {}))
    return "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                   for g, eps in groups.items())


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_own_wheel(proj: Path, out: Path) -> Path:
    """A py3-none-any wheel of the project at ``proj`` (what hatchling would put in it for the
    settings this repository uses), written into ``out``; returns its path."""
    project, packages = _project(proj)
    dist = re.sub(r"[-_.]+", "_", project["name"])
    version = project["version"]
    info = f"{dist}-{version}.dist-info"
    files = [(rel, path.read_bytes()) for rel, path in _package_files(proj, packages)]
    files.append((f"{info}/METADATA", _metadata(project, proj).encode()))
    files.append((f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: engine scripts/gpu_kit.py\n"
                                   b"Root-Is-Purelib: true\nTag: py3-none-any\n"))
    eps = _entry_points(project)
    if eps:
        files.append((f"{info}/entry_points.txt", eps.encode()))
    record = "".join(_record_line(n, d) + "\n" for n, d in files) + f"{info}/RECORD,,\n"
    files.append((f"{info}/RECORD", record.encode()))
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files:
            zi = zipfile.ZipInfo(name, ZIP_DATE)
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
    return target


# ---- wheels' facts ----------------------------------------------------------------------------
def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist()
                    if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = zf.read(meta).decode()
    head = text.split("\n\n", 1)[0]
    fields = [line.split(": ", 1) for line in head.splitlines() if ": " in line]
    get = {k: v for k, v in fields if k in ("Name", "Version")}
    return get["Name"], get["Version"], [v for k, v in fields if k == "Requires-Dist"]


def wheel_tags(path: Path) -> list[str]:
    parts = path.name[:-4].split("-")
    py, abi, plats = parts[-3:]
    return [f"{p}-{a}-{pl}" for p in py.split(".") for a in abi.split(".")
            for pl in plats.split(".")]


def fits_target(tag: str) -> bool:
    """Whether a wheel tag installs on CPython 3.12, manylinux x86_64."""
    py, abi, plat = tag.split("-")
    py_ok = py in ("py3", "py312", "cp312") or (
        abi == "abi3" and py.startswith("cp3") and py[3:].isdigit() and int(py[3:]) <= 12)
    plat_ok = plat == "any" or (plat.startswith("manylinux") and plat.endswith("x86_64"))
    return py_ok and abi in ("none", "abi3", "cp312") and plat_ok


def is_pure(path: Path) -> bool:
    return path.name.endswith("-none-any.whl")


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def target_env(python_version: str) -> dict:
    """packaging's marker environment of the lent machine (CPython on Linux x86_64)."""
    return {"python_version": python_version, "python_full_version": python_version + ".3",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "platform_machine": "x86_64", "extra": ""}


def unmet_requirements(wheels: dict[str, str], requires: dict[str, list[str]],
                       have: dict[str, str | None], env: dict) -> list[str]:
    """Requirements (no extras) of the wheels that neither the wheels nor ``have`` (name ->
    version, None where unknown) satisfy, as 'wheel: requirement (why)'."""
    _, Requirement, canonicalize_name, Version = _packaging()
    missing = []
    for name, reqs in requires.items():
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            key = canonicalize_name(req.name)
            version = wheels.get(key, have.get(key, "absent"))
            if version == "absent":
                missing.append(f"{name}: {line} (not in the kit nor on the machine)")
            elif version is not None and not req.specifier.contains(Version(version),
                                                                     prereleases=True):
                missing.append(f"{name}: {line} (found {version})")
    return missing


# ---- build ------------------------------------------------------------------------------------
def default_cache() -> Path:
    base = os.environ.get("ENGINE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                              "engine")
    return Path(base) / "gpu-kit"


def download(carry: list[dict], cfg: dict, cache: Path) -> dict[str, Path]:
    """name -> the cached wheel of each carried package (pip download once, then reused)."""
    cache.mkdir(parents=True, exist_ok=True)

    def find(entry):
        stem = re.sub(r"[-_.]+", "_", entry["name"]).lower()
        for whl in cache.glob("*.whl"):
            n, v = whl.name.split("-")[:2]
            if n.lower() == stem and v == entry["version"]:
                return whl
        return None

    todo = [e for e in carry if find(e) is None]
    if todo:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "off",
               "--python-version", cfg["python_version"], "--implementation", "cp",
               *[a for p in cfg["platforms"] for a in ("--platform", p)], "-d", str(cache),
               *[f"{e['name']}=={e['version']}" for e in todo]]
        print("$", " ".join(cmd[3:6]), "...", " ".join(cmd[-len(todo):]), flush=True)
        subprocess.run(cmd, check=True)
    found = {e["name"]: find(e) for e in carry}
    lost = [n for n, p in found.items() if p is None]
    if lost:
        raise SystemExit(f"pip download saved no wheel for {lost} in {cache}")
    return found


def build(kit: Path, own_only: bool, cache: Path) -> dict:
    cfg = load_config()
    cap = cfg["cap_mib"] * MiB
    started = time.time()
    if kit.exists():
        shutil.rmtree(kit)
    kit.mkdir(parents=True)
    (kit / ".gitignore").write_text("*\n")  # never committed, wherever it is made
    wheels, left_out = [], []
    total = 0
    for proj in own_projects():
        path = build_own_wheel(proj, kit)
        name, version, reqs = wheel_metadata(path)
        size = path.stat().st_size
        total += size
        wheels.append({"file": path.name, "name": name, "version": version, "kind": "own",
                       "size": size, "sha256": sha256_file(path), "requires": reqs,
                       "project": proj.relative_to(ROOT).as_posix(),
                       "source_sha256": source_hash(proj), "pure": True,
                       "why": "this repository"})
    if total > cap:
        raise SystemExit(f"this repository's own wheels alone are {total / MiB:.1f} MiB, over "
                         f"the {cfg['cap_mib']} MiB cap")
    carry = [] if own_only else cfg.get("carry", [])
    cached = download(carry, cfg, cache) if carry else {}
    for entry in carry:
        src = cached[entry["name"]]
        size = src.stat().st_size
        if total + size > cap:
            left_out.append({"name": entry["name"], "version": entry["version"],
                             "size": f"{size / MiB:.1f} MiB ({src.name})",
                             "why": f"would take the kit past the {cfg['cap_mib']} MiB cap "
                                    f"({total / MiB:.1f} MiB before it)",
                             "skips": f"what needs {entry['name']} ({entry['why']})"})
            continue
        shutil.copy2(src, kit / src.name)
        name, version, reqs = wheel_metadata(kit / src.name)
        total += size
        wheels.append({"file": src.name, "name": name, "version": version, "kind": "dependency",
                       "size": size, "sha256": sha256_file(kit / src.name), "requires": reqs,
                       "pure": is_pure(src), "why": entry["why"]})
    left_out += [dict(e) for e in cfg.get("left_out", [])]
    if own_only:
        left_out += [{"name": e["name"], "version": e["version"], "size": "not fetched",
                      "why": "kit built with --own-only (no third-party wheels)",
                      "skips": e["why"]} for e in cfg.get("carry", [])]
    machine = cfg["machine"]
    have = {canon(n): None for n in machine["packages"]}
    have.update({canon(n): v for n, v in machine["versions"].items()})
    unmet = unmet_requirements({canon(w["name"]): w["version"] for w in wheels},
                               {w["name"]: w["requires"] for w in wheels}, have,
                               target_env(cfg["python_version"]))
    known_out = {canon(e["name"]) for e in left_out}
    blocking = [u for u in unmet if not own_only and canon(re.split(r"[:;<>=!~ \[(]", u.split(
        ": ", 1)[1])[0]) not in known_out]
    manifest = {
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.time() - started, 1),
        "target": f"cp{cfg['python_version'].replace('.', '')} manylinux x86_64, the machine's "
                  f"own torch {machine['versions'].get('torch', '?')}",
        "cap_bytes": cap, "total_bytes": total, "own_only": own_only,
        "machine_packages_read": machine["read"],
        "wheels": wheels, "left_out": left_out, "unmet_requirements": unmet,
    }
    (kit / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (kit / "MANIFEST.txt").write_text(manifest_text(manifest))
    print(manifest_text(manifest), end="")
    if blocking:
        raise SystemExit("requirements neither the kit nor the machine meets:\n  "
                         + "\n  ".join(blocking))
    return manifest


def manifest_text(m: dict) -> str:
    lines = [f"GPU kit for {m['target']}; built {m['built']}",
             f"{len(m['wheels'])} wheels, {m['total_bytes'] / MiB:.2f} MiB of the "
             f"{m['cap_bytes'] / MiB:.0f} MiB cap", ""]
    for w in m["wheels"]:
        lines.append(f"  {w['size'] / 1024:>9.1f} KiB  {w['file']}  [{w['kind']}: {w['why']}]")
    lines += ["", "left out:"]
    for e in m["left_out"]:
        lines.append(f"  {e['name']} {e['version']}: {e['size']}; {e['why']} "
                     f"(skips: {e['skips']})")
    if m["unmet_requirements"]:
        lines += ["", "requirements the kit and the machine's package list leave unmet:"]
        lines += [f"  {u}" for u in m["unmet_requirements"]]
    return "\n".join(lines) + "\n"


# ---- verify / install / unmet -----------------------------------------------------------------
def read_manifest(kit: Path) -> dict:
    path = kit / "MANIFEST.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `make gpu-kit` first")
    return json.loads(path.read_text())


def verify(kit: Path) -> list[str]:
    """Problems with the kit: files vs the manifest (names, sizes, hashes), one version per
    package, the cap, cp312/manylinux x86_64 tags. Empty when the kit is sound."""
    m, problems = read_manifest(kit), []
    listed = {w["file"]: w for w in m["wheels"]}
    present = {p.name: p for p in kit.glob("*.whl")}
    problems += [f"{f}: in the manifest, not in the kit"
                 for f in sorted(set(listed) - set(present))]
    problems += [f"{f}: in the kit, not in the manifest"
                 for f in sorted(set(present) - set(listed))]
    names = [canon(w["name"]) for w in m["wheels"]]
    problems += [f"{n}: more than one version" for n in sorted({n for n in names
                                                                if names.count(n) > 1})]
    total = 0
    for f, p in sorted(present.items()):
        total += p.stat().st_size
        w = listed.get(f)
        if w and (w["size"] != p.stat().st_size or w["sha256"] != sha256_file(p)):
            problems.append(f"{f}: size or sha256 differs from the manifest")
        if not any(fits_target(t) for t in wheel_tags(p)):
            problems.append(f"{f}: no tag for cp312 manylinux x86_64")
    everything = sum(p.stat().st_size for p in kit.iterdir() if p.is_file())
    if everything > m["cap_bytes"]:
        problems.append(f"the kit holds {everything / MiB:.2f} MiB, over the "
                        f"{m['cap_bytes'] / MiB:.0f} MiB cap")
    if total != m["total_bytes"]:
        problems.append(f"wheels total {total} bytes, the manifest says {m['total_bytes']}")
    return problems


def stale_own(m: dict) -> list[dict]:
    """The kit's own wheels whose sources changed since the kit was built."""
    return [w for w in m["wheels"] if w["kind"] == "own"
            and source_hash(ROOT / w["project"]) != w["source_sha256"]]


def install(kit: Path, target: Path, dry_run: bool, python_version: str) -> dict:
    """Install the kit into ``target`` with pip (--no-index --no-deps): an own wheel whose
    sources changed since the build is rebuilt first; a dependency this Python already has at
    the same or a newer version is skipped (the machine's wins). With ``dry_run`` (a CPU
    machine that is not the target) nothing is skipped, the pure wheels install for this
    Python and the others for cp312 manylinux x86_64 into a second folder."""
    import importlib.metadata as md

    _, _, _, Version = _packaging()
    m = read_manifest(kit)
    report = {"installed": [], "skipped": [], "rebuilt": [], "target": str(target)}
    files = []
    rebuild = tempfile.mkdtemp(prefix="gpu-kit-own-")
    stale = {w["file"] for w in stale_own(m)}
    for w in m["wheels"]:
        path = kit / w["file"]
        if w["file"] in stale:
            path = build_own_wheel(ROOT / w["project"], Path(rebuild))
            report["rebuilt"].append(w["name"])
        if w["kind"] == "dependency" and not dry_run:
            try:
                there = md.version(w["name"])
            except md.PackageNotFoundError:
                there = None
            if there is not None and Version(there) >= Version(w["version"]):
                report["skipped"].append(f"{w['name']} {w['version']} (this Python has {there})")
                continue
        files.append((path, w))
    base = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
            "--no-compile", "--no-cache-dir", "--upgrade"]
    pure = [str(p) for p, w in files if w["pure"] or not dry_run]
    binary = [str(p) for p, w in files if not w["pure"] and dry_run]
    target.mkdir(parents=True, exist_ok=True)
    failed = []

    def pip(extra: list[str], wheels: list[str]) -> None:
        """All at once; if pip refuses, one by one, so that one bad wheel costs only itself."""
        if subprocess.run([*base, *extra, *wheels]).returncode == 0:
            return
        for whl in wheels:
            if subprocess.run([*base, *extra, whl]).returncode != 0:
                failed.append(Path(whl).name)

    if pure:
        pip(["--target", str(target)], pure)
    if binary:
        plat = [a for p in load_config()["platforms"] for a in ("--platform", p)]
        pip(["--target", str(target) + "-cp312", "--only-binary=:all:", "--python-version",
             python_version, "--implementation", "cp", *plat], binary)
        report["binary_target"] = str(target) + "-cp312"
    report["installed"] = [Path(p).name for p in pure + binary if Path(p).name not in failed]
    report["failed"] = failed
    return report


def unmet_here(kit: Path) -> list[str]:
    """The kit's wheels' requirements this Python (with the kit on its path) does not meet."""
    import importlib.metadata as md
    import platform

    m = read_manifest(kit)
    have = {}
    for dist in md.distributions():
        have.setdefault(canon(dist.metadata["Name"]), dist.version)
    env = target_env(platform.python_version().rsplit(".", 1)[0])
    env["python_full_version"] = platform.python_version()
    return unmet_requirements({}, {w["name"]: w["requires"] for w in m["wheels"]}, have, env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["build", "verify", "install", "unmet", "stale"])
    ap.add_argument("--kit", default=str(ROOT / ".gpu-kit"))
    ap.add_argument("--own-only", action="store_true",
                    help="build: only this repository's wheels (no download)")
    ap.add_argument("--cache", default=None, help="build: where downloaded wheels are kept")
    ap.add_argument("--target", help="install: the folder to install into")
    ap.add_argument("--dry-run", action="store_true",
                    help="install: on a CPU machine (nothing skipped; cp312 tags for binaries)")
    ap.add_argument("--json", help="install/verify/unmet: also write the result here")
    args = ap.parse_args()
    kit = Path(args.kit)
    result: object
    if args.command == "build":
        build(kit, args.own_only, Path(args.cache) if args.cache else default_cache())
        problems = verify(kit)
        if problems:
            raise SystemExit("the kit just built fails its checks:\n  " + "\n  ".join(problems))
        return
    if args.command == "verify":
        result = verify(kit)
        print("\n".join(result) if result else f"kit OK: {kit}")
    elif args.command == "install":
        if not args.target:
            ap.error("install needs --target")
        result = install(kit, Path(args.target), args.dry_run, load_config()["python_version"])
        print(json.dumps(result, indent=1))
        if result["failed"]:
            print(f"pip could not install: {', '.join(result['failed'])}", file=sys.stderr)
    elif args.command == "stale":
        result = [w["name"] for w in stale_own(read_manifest(kit))]
        print("\n".join(result) if result else "own wheels match the working tree")
    else:
        result = unmet_here(kit)
        print("\n".join(result) if result else "every requirement of the kit's wheels is met")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if (args.command == "verify" and result) or (args.command == "install" and result["failed"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
