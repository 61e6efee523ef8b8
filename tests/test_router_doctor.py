"""`engine doctor` against a --dp-size front: its /metrics has each replica's series and their
totals; doctor must count them once (issue 28)."""

from __future__ import annotations

import json

from click.testing import CliRunner

import engine_cli.doctor_cmd as doctor
from engine.router.aggregate import aggregate
from engine.router.replicas import Replica
from engine_cli.main import cli


def replica_metrics(running, queued, usage, retracted):
    return (f"# HELP engine:num_running_reqs Running requests.\n"
            f"# TYPE engine:num_running_reqs gauge\n"
            f'engine:num_running_reqs{{model_name="m"}} {running}\n'
            f"# HELP engine:num_queue_reqs Queued requests.\n"
            f"# TYPE engine:num_queue_reqs gauge\n"
            f'engine:num_queue_reqs{{model_name="m"}} {queued}\n'
            f"# HELP engine:token_usage Token usage.\n"
            f"# TYPE engine:token_usage gauge\n"
            f'engine:token_usage{{model_name="m"}} {usage}\n'
            f"# HELP engine:num_retracted_reqs Retracted requests.\n"
            f"# TYPE engine:num_retracted_reqs counter\n"
            f'engine:num_retracted_reqs_total{{model_name="m"}} {retracted}\n')


def front_metrics() -> str:
    return aggregate({0: replica_metrics(3, 5, 0.5, 2), 1: replica_metrics(4, 1, 0.7, 1)},
                     [Replica(0, 1), Replica(1, 2)])


def test_doctor_reads_the_fronts_totals_once():
    values = doctor._metrics(front_metrics())
    assert values["engine:num_running_reqs"] == 7  # 3 + 4, not 14
    assert values["engine:num_queue_reqs"] == 6
    assert abs(values["engine:token_usage"] - 0.6) < 1e-9  # the mean the front reports
    assert values["engine:num_retracted_reqs_total"] == 3
    # a single server's metrics are read as before
    single = doctor._metrics(replica_metrics(3, 5, 0.5, 2))
    assert single["engine:num_running_reqs"] == 3 and single["engine:token_usage"] == 0.5


def test_doctor_against_a_dp_front_samples_totals_and_scales_the_cap(monkeypatch):
    info = {"dp_size": 2, "live_replicas": 2, "max_running_requests": 8,
            "served_model_name": "m", "prefill_oom_errors": 1,
            "advice": [{"symptom": "prefill_oom", "message": "m1", "step": 4, "dp_rank": 1}]}

    def get(url, key):
        return front_metrics().encode() if url.endswith("/metrics") else json.dumps(info).encode()

    monkeypatch.setattr(doctor, "_get", get)
    s, _ = doctor.sample("http://front", None)
    assert (s.running, s.queued, s.retracted_total, s.prefill_oom_total) == (7, 6, 3, 1)
    seen = {}
    monkeypatch.setattr(doctor, "diagnose", lambda samples, settings: seen.update(
        settings=settings) or [])
    out = CliRunner().invoke(cli, ["doctor", "--url", "http://front", "--duration", "0"])
    assert out.exit_code == 0, out.output
    assert seen["settings"].max_running_requests == 16  # 8 per replica x 2 live
    assert "a --dp-size 2 front, 2 replica(s) live" in out.output
    assert "[prefill_oom] (the server's advisor, dp rank 1, step 4) m1" in out.output
