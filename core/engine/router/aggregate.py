"""/metrics of the dp front: every replica's samples with a ``dp_rank`` label, then the total
over the live replicas (no ``dp_rank`` label), then the router's own series."""

from __future__ import annotations

import re
from collections import OrderedDict

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
# gauges that are ratios: the total is the mean over the replicas, not the sum
_MEAN = ("engine:token_usage", "engine:gpu_cache_usage_perc", "engine:kv_cache_usage_perc")


def _parse(text: str) -> "OrderedDict[str, dict]":
    """family -> {"meta": [# lines], "samples": [(name, labels, value)]}."""
    families: OrderedDict[str, dict] = OrderedDict()
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                current = families.setdefault(parts[2], {"meta": [], "samples": []})
                current["meta"].append(line)
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if current is None:
            current = families.setdefault(name, {"meta": [], "samples": []})
        current["samples"].append((name, labels, value))
    return families


def _with_rank(labels: str, rank: int) -> str:
    return f'dp_rank="{rank}"' + ("," + labels if labels else "")


def _fmt(name: str, labels: str, value: float) -> str:
    return f"{name}{{{labels}}} {value!r}" if labels else f"{name} {value!r}"


def aggregate(per_replica: dict[int, str], replicas) -> str:
    """``per_replica``: rank -> the /metrics text of each live replica that answered;
    ``replicas``: every :class:`~engine.router.replicas.Replica` (for the router's series)."""
    parsed = {rank: _parse(text) for rank, text in per_replica.items()}
    order: OrderedDict[str, list] = OrderedDict()
    for fams in parsed.values():
        for fam, data in fams.items():
            order.setdefault(fam, data["meta"])
    totals: dict[tuple[str, str], list[float]] = {}  # every sample first: totals use others
    for fams in parsed.values():
        for data in fams.values():
            for name, labels, value in data["samples"]:
                totals.setdefault((name, labels), []).append(value)
    lines: list[str] = []
    for fam, meta in order.items():
        lines.extend(meta)
        keys: dict[tuple[str, str], None] = {}
        for rank, fams in parsed.items():
            for name, labels, value in fams.get(fam, {"samples": ()})["samples"]:
                lines.append(_fmt(name, _with_rank(labels, rank), value))
                keys.setdefault((name, labels))
        for name, labels in keys:
            lines.append(_fmt(name, labels, _total(name, labels, totals)))
    live = sum(r.alive for r in replicas)
    lines += ["# HELP engine:dp_replica_up 1 while the dp replica is in rotation, 0 once it died.",
              "# TYPE engine:dp_replica_up gauge"]
    lines += [f'engine:dp_replica_up{{dp_rank="{r.rank}"}} {int(r.alive)}' for r in replicas]
    lines += [f"engine:dp_replica_up {live}",
              "# HELP engine:dp_routed_requests_total Requests the router sent to each replica.",
              "# TYPE engine:dp_routed_requests_total counter"]
    lines += [f'engine:dp_routed_requests_total{{dp_rank="{r.rank}"}} {r.routed}'
              for r in replicas]
    lines.append(f"engine:dp_routed_requests_total {sum(r.routed for r in replicas)}")
    lines += ["# HELP engine:dp_replica_restarts_total Times the front restarted each replica "
              "after its process died.",
              "# TYPE engine:dp_replica_restarts_total counter"]
    lines += [f'engine:dp_replica_restarts_total{{dp_rank="{r.rank}"}} {r.restarts}'
              for r in replicas]
    lines.append(f"engine:dp_replica_restarts_total {sum(r.restarts for r in replicas)}")
    return "\n".join(lines) + "\n"


def _total(name: str, labels: str, totals: dict) -> float:
    values = totals[(name, labels)]
    if name in _MEAN:
        return sum(values) / len(values)
    if name == "engine:cache_hit_rate":  # cached / prompt tokens over every replica
        prompt = sum(totals.get(("engine:prompt_tokens_total", labels), ()))
        cached = sum(totals.get(("engine:cached_tokens_total", labels), ()))
        return cached / prompt if prompt else 0.0
    if name.endswith("_created"):
        return min(values)
    return sum(values)
