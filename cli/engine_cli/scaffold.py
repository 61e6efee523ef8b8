"""`engine plugins new NAME --kind KIND`: a ready-to-install plugin package from templates/."""

from __future__ import annotations

import keyword
import re
from importlib import metadata, resources
from pathlib import Path
from string import Template

from engine.errors import EngineError
from engine.hookspecs import ENGINE_HOOKS_VERSION

NAME_RE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
MAX_NAME = 40

# kind -> (the registry its name goes to, or None; what it adds; how a user turns it on)
KINDS = {
    "attention": ("attention", "attention backend '{name}'",
                  "engine serve --attention-backend {name}"),
    "policy": ("policies", "schedule policy '{name}'", "engine serve --schedule-policy {name}"),
    "quant": ("quantization", "quantization method '{name}'",
              "engine serve --quantization {name}"),
    "kv-dtype": ("kv_dtypes", "KV-cache dtype '{name}'",
                 "engine serve --kv-cache-dtype {name} --attention-backend torch_native"),
    "speculative": ("speculative", "speculative algorithm '{name}'",
                    "engine serve --speculative-algorithm {name}"),
    "command": (None, "the subcommand `engine {command}`", "engine {command} --help"),
    "observer": (None, "a step observer '{name}'",
                 "engine serve (it watches every engine; its log lines start with '{name}:')"),
}


class ScaffoldError(EngineError, ValueError):
    pass


def check_name(name: str, kind: str, commands=()) -> None:
    """Refuse a name that is not a lowercase identifier, or that something installed has;
    ``commands``: the names the `engine` group's subcommands already have."""
    if not NAME_RE.fullmatch(name) or len(name) > MAX_NAME or keyword.iskeyword(name):
        raise ScaffoldError(
            f"'{name}' is not a plugin name: use lowercase letters and digits, words joined by "
            f"single underscores, starting with a letter, at most {MAX_NAME} characters (e.g. "
            f"shortest_first). It names the registered {kind}, the package engine_NAME and the "
            f"distribution engine-NAME.")
    dist = "engine-" + name.replace("_", "-")
    try:
        found = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        found = None
    if found is not None:
        raise ScaffoldError(f"a distribution named {dist} is already installed "
                            f"({found.version}); pick another name.")
    from engine.plugins import get_registries

    registry = getattr(get_registries(), KINDS[kind][0]) if KINDS[kind][0] else ()
    if name in registry:
        raise ScaffoldError(f"{registry.kind} '{name}' is already registered by "
                            f"{registry.get(name).origin}; pick another name.")
    if kind == "command" and name.replace("_", "-") in commands:
        raise ScaffoldError(f"`engine {name.replace('_', '-')}` already exists; pick "
                            f"another name.")


def render(template: str, values: dict) -> str:
    text = resources.files("engine_cli").joinpath("templates", template).read_text()
    return Template(text).substitute(values)


def write_package(name: str, kind: str, parent: str = ".", commands=()) -> Path:
    """Write engine-NAME/ under ``parent``: pyproject.toml (setuptools, the "engine" entry
    point), README.md, engine_NAME/__init__.py and tests/test_NAME.py. Returns the folder.
    ``commands``: the `engine` group's subcommand names, which a command plugin must not take."""
    if kind not in KINDS:
        raise ScaffoldError(f"--kind {kind!r}: use one of {', '.join(KINDS)}.")
    check_name(name, kind, commands)
    dist = "engine-" + name.replace("_", "-")
    folder = Path(parent) / dist
    if folder.exists():
        raise ScaffoldError(f"{folder} already exists; remove it or pass another --dir "
                            f"(nothing was written).")
    _, adds, usage = KINDS[kind]
    values = {"name": name, "dist": dist, "package": dist.replace("-", "_"),
              "command": name.replace("_", "-"), "kind": kind,
              "klass": "".join(w.capitalize() for w in name.split("_")),
              "hooks_version": ENGINE_HOOKS_VERSION}
    values["adds"] = adds.format(**values)
    values["usage"] = usage.format(**values)
    slug = kind.replace("-", "_")
    files = {
        "pyproject.toml": render("pyproject.toml.tmpl", values),
        "README.md": render("README.md.tmpl", values),
        f"{values['package']}/__init__.py": render(f"{slug}.py.tmpl", values),
        f"tests/test_{name}.py": render(f"test_{slug}.py.tmpl", values),
    }
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder
