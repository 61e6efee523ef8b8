"""`engine plugins`: what is installed and what can run here."""

from __future__ import annotations

import json

import click

from engine.plugins import get_registries, list_plugins
from engine.registry import backend_kv_dtypes

SECTIONS = (
    ("attention", "Attention backends"),
    ("policies", "Schedule policies"),
    ("quantization", "Quantization methods"),
    ("kv_dtypes", "KV-cache dtypes"),
    ("parallel", "Parallel strategies"),
    ("routing", "Routing policies (--dp-size)"),
    ("models", "Model architectures"),
)


def collect(device) -> dict:
    regs = get_registries()
    out = {"device": device.describe(), "plugins": [], "errors": []}
    for info in list_plugins():
        out["plugins"].append({"name": info.name, "dist": info.dist, "version": info.version,
                               "hooks": sorted(info.hooks), "registered": info.registered,
                               "error": info.error})
        if info.error:
            out["errors"].append({"plugin": info.name, "dist": info.dist, "error": info.error})
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


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins_command(as_json):
    """List installed plugins and every registered name, with availability here."""
    from engine.device import detect_device

    data = collect(detect_device())
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"Device: {data['device']}\n\nPlugin distributions:")
    rows = [["DISTRIBUTION", "VERSION", "PLUGIN", "HOOKS"]]
    for p in data["plugins"]:
        rows.append([p["dist"], p["version"], p["name"], ", ".join(p["hooks"])])
    click.echo(_table(rows))
    for key, title in SECTIONS:
        click.echo(f"\n{title}:")
        rows = [["NAME", "PROVIDED BY", "AVAILABLE HERE"]]
        for r in data[key]:
            origin = "built-in" if r["dist"] == "built-in" else f"{r['dist']} {r['version']}"
            avail = "yes" if r["available"] else f"no — {r['reason']}"
            rows.append([r["name"], origin, avail])
        click.echo(_table(rows) if len(rows) > 1 else "  (none installed)")
    if data["errors"]:
        click.echo("\nPlugin errors:")
        for e in data["errors"]:
            click.echo(f"  {e['plugin']} ({e['dist']}): {e['error']}")
