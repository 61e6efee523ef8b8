"""`engine plugins`: what is installed and what can run here; `engine plugins new`: a new one."""

from __future__ import annotations

import json

import click

from engine.hookspecs import ENGINE_HOOKS_VERSION
from engine.plugins import get_registries, list_plugins
from engine.registry import backend_kv_dtypes

SECTIONS = (
    ("attention", "Attention backends"),
    ("policies", "Schedule policies"),
    ("quantization", "Quantization methods"),
    ("kv_dtypes", "KV-cache dtypes"),
    ("parallel", "Parallel strategies"),
    ("routing", "Routing policies (--dp-size)"),
    ("grammar", "Grammar backends (--grammar-backend)"),
    ("speculative", "Speculative algorithms (--speculative-algorithm)"),
    ("tool_parsers", "Tool-call parsers (--tool-call-parser)"),
    ("reasoning_parsers", "Reasoning parsers (--reasoning-parser)"),
    ("hicache_storage", "HiCache storage backends (--hicache-storage-backend)"),
    ("models", "Model architectures"),
)


def collect(device) -> dict:
    regs = get_registries()
    out = {"device": device.describe(), "hooks_version": ENGINE_HOOKS_VERSION, "plugins": [],
           "errors": [], "incompatible": []}
    for info in list_plugins():
        out["plugins"].append({"name": info.name, "dist": info.dist, "version": info.version,
                               "hooks": sorted(info.hooks), "registered": info.registered,
                               "error": info.error, "hooks_version": info.hooks_version,
                               "incompatible": info.incompatible})
        if info.error:
            out["errors"].append({"plugin": info.name, "dist": info.dist, "error": info.error})
        if info.incompatible:
            out["incompatible"].append({
                "plugin": info.name, "dist": info.dist, "version": info.version,
                "hooks_version": info.hooks_version, "reason": info.incompatible,
                "names": info.withheld})
    for key, _ in SECTIONS:
        rows = []
        for entry in regs.all()[key]:
            reason = entry.unavailable_reason(device)
            rows.append({"name": entry.name, "dist": entry.dist, "version": entry.version,
                         "plugin": entry.plugin, "available": reason is None, "reason": reason,
                         **{k: list(v) if isinstance(v, tuple) else v
                            for k, v in entry.extra.items()}})
            if key == "attention":  # "any" spelled out: every registered KV dtype
                rows[-1]["kv_dtypes"] = backend_kv_dtypes(regs, entry)
        out[key] = rows
    return out


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in rows)


@click.group("plugins", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def plugins_command(ctx, as_json):
    """List installed plugins and every registered name, with availability here.

    `engine plugins new NAME --kind KIND` writes a new plugin package to start from."""
    if ctx.invoked_subcommand is not None:
        return
    from engine.device import detect_device

    data = collect(detect_device())
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"Device: {data['device']}\n\nPlugin distributions:")
    rows = [["DISTRIBUTION", "VERSION", "PLUGIN", "HOOKS"]]
    for p in data["plugins"]:
        hooks = "(not loaded: see below)" if p["incompatible"] else ", ".join(p["hooks"])
        rows.append([p["dist"], p["version"], p["name"], hooks])
    click.echo(_table(rows))
    for key, title in SECTIONS:
        click.echo(f"\n{title}:")
        rows = [["NAME", "PROVIDED BY", "AVAILABLE HERE"]]
        for r in data[key]:
            origin = "built-in" if r["dist"] == "built-in" else f"{r['dist']} {r['version']}"
            avail = "yes" if r["available"] else f"no — {r['reason']}"
            rows.append([r["name"], origin, avail])
        click.echo(_table(rows) if len(rows) > 1 else "  (none installed)")
    if data["incompatible"]:
        click.echo(f"\nNot loaded (built for another hook contract; this engine offers "
                   f"{ENGINE_HOOKS_VERSION}):")
        for e in data["incompatible"]:
            click.echo(f"  {e['dist']} {e['version']} (plugin {e['plugin']}): {e['reason']}")
    if data["errors"]:
        click.echo("\nPlugin errors:")
        for e in data["errors"]:
            click.echo(f"  {e['plugin']} ({e['dist']}): {e['error']}")


@plugins_command.command("new")
@click.argument("name")
@click.option("--kind", required=True, type=click.Choice(
    ["attention", "policy", "quant", "kv-dtype", "command", "observer", "speculative"]),
    help="What the plugin adds.")
@click.option("--dir", "parent", default=".", show_default=True,
              type=click.Path(file_okay=False), help="Where to create the package's folder.")
@click.pass_context
def new_command(ctx, name, kind, parent):
    """Write a ready-to-install plugin package NAME (pyproject with the entry point, the hook
    implementation, a README and a test) into a new folder engine-NAME."""
    from engine_cli.scaffold import ScaffoldError, write_package

    try:
        folder = write_package(name, kind, parent, ctx.find_root().command.commands)
    except ScaffoldError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"Wrote {folder}. Next:\n  pip install -e {folder}\n  engine plugins\n"
               f"  pytest {folder}")
