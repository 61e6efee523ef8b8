"""`engine doctor --url URL`: the tuning guides' advice for a running server.

It prints what the server's own advisor (the engine-advisor plugin) has published at
/get_server_info, then polls /metrics and /get_server_info for ``--duration`` seconds and runs
the same rules (engine.advice) on what it saw.

Against a ``--dp-size`` front, /metrics has each replica's series (``dp_rank`` label) and their
totals (no ``dp_rank``): doctor reads the totals only, and compares them with
``--max-running-requests`` times the live replicas.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from time import monotonic, sleep

import click
from engine.advice import Sample, Settings, diagnose


def _get(url: str, api_key: str | None) -> bytes:
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise click.ClickException(f"{url} answered 401: the server wants an API key; "
                                       f"pass --api-key (its --api-key).") from None
        raise click.ClickException(f"{url} answered {e.code}: {e.read()[:200]!r}") from None
    except (urllib.error.URLError, OSError) as e:
        raise click.ClickException(f"cannot reach {url}: {getattr(e, 'reason', e)}; is "
                                   f"`engine serve` running there?") from None


def _metrics(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "dp_rank" in s.labels:  # a dp front's per-replica series: the totals follow
                continue
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def sample(url: str, api_key: str | None) -> tuple[Sample, dict]:
    """One poll: /metrics for the gauges and the retraction counter, /get_server_info for the
    flags, the prefill out-of-memory count and the advisor's advice."""
    m = _metrics(_get(f"{url}/metrics", api_key).decode())
    info = json.loads(_get(f"{url}/get_server_info", api_key))
    try:
        s = Sample(monotonic(), int(m["engine:num_running_reqs"]),
                   int(m["engine:num_queue_reqs"]), m["engine:token_usage"],
                   int(m.get("engine:num_retracted_reqs_total", 0)),
                   int(info.get("prefill_oom_errors", 0)))
    except KeyError as e:
        raise click.ClickException(f"{url}/metrics has no {e.args[0]}: is it an engine "
                                   f"server (engine serve)?") from None
    return s, info


@click.command("doctor")
@click.option("--url", required=True, help="The server, e.g. http://127.0.0.1:30000")
@click.option("--api-key", help="The server's --api-key, if it has one.")
@click.option("--duration", default=10.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds to watch the server (0: only what its advisor already saw).")
@click.option("--interval", default=0.25, show_default=True, type=click.FloatRange(min=0.01),
              help="Seconds between two polls.")
def doctor_command(url, api_key, duration, interval):
    """Print the tuning guides' advice for a running server (see the engine-advisor plugin)."""
    url = url.rstrip("/")
    first, info = sample(url, api_key)
    samples = [first]
    deadline = monotonic() + duration
    while monotonic() < deadline:
        sleep(interval)
        s, info = sample(url, api_key)
        samples.append(s)
    replicas = info.get("live_replicas", 1) if info.get("dp_size", 1) > 1 else 1
    settings = Settings(info["max_running_requests"] * max(1, replicas),
                        info.get("chunked_prefill_size"),
                        info.get("schedule_conservativeness", 1.0))
    published = info.get("advice")
    busy = sum(1 for s in samples if s.busy)
    click.echo(f"engine doctor: {url} ({info.get('served_model_name')}); {len(samples)} polls "
               f"over {duration:g} s, {busy} with requests in flight")
    if info.get("dp_size", 1) > 1:
        click.echo(f"(a --dp-size {info['dp_size']} front, {replicas} replica(s) live: the "
                   f"numbers are their totals, against --max-running-requests "
                   f"{info['max_running_requests']} x {replicas})")
    if published is None:
        click.echo("(the server runs no advisor: pip install engine-advisor there for advice "
                   "from every step)")
    given = set()
    for advice in published or ():
        given.add(advice["symptom"])
        where = f"dp rank {advice['dp_rank']}, " if "dp_rank" in advice else ""
        click.echo(f"[{advice['symptom']}] (the server's advisor, {where}step "
                   f"{advice.get('step')}) {advice['message']}")
    for advice in diagnose(samples, settings):
        if advice.symptom not in given:
            given.add(advice.symptom)
            click.echo(f"[{advice.symptom}] (seen now) {advice.message}")
    if not given:
        click.echo("no symptom the tuning guides describe" + (
            "" if busy else " (the server was idle while watched: run it under load)"))
