"""`engine bench` and engine.bench: the workloads, the offline and serve runs, the output forms,
and `engine serve --record-trace` replayed as a workload."""

import json
import math
import random
import time

import pytest
from click.testing import CliRunner

from engine.bench import Workload, format_table, run_bench
from engine.bench.workloads import (poisson_arrivals, random_requests, read_trace,
                                    shared_prefix_requests, token_pool)
from engine.registry import EngineError
from engine_cli.main import cli

TABLE_LINES = ("Successful requests:", "Benchmark duration (s):", "Request throughput (req/s):",
               "Input token throughput (tok/s):", "Output token throughput (tok/s):",
               "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Mean ITL (ms):",
               "Median ITL (ms):", "P99 ITL (ms):", "Mean E2E Latency (ms):",
               "Median E2E Latency (ms):", "P99 E2E Latency (ms):", "Peak token usage:",
               "Mean token usage:", "Mean #queue-req:", "Retractions:", "Cache hit rate:")
SMALL = dict(num_prompts=8, random_input_len=24, random_output_len=6, random_range_ratio=0.5)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    from engine.models.checkpoint import load_tokenizer_dir

    return load_tokenizer_dir(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def engine(model):
    from engine import Engine

    return Engine(model, max_total_tokens=600)


# -- workloads ---------------------------------------------------------------------------------
def test_random_lengths_stay_in_their_ranges(tokenizer):
    vocab = token_pool(tokenizer)
    reqs = random_requests(vocab, 200, 40, 20, 0.5, random.Random(0))
    assert {len(r.prompt) for r in reqs} == {r.input_len for r in reqs} == set(range(20, 41))
    assert {r.output_len for r in reqs} == set(range(10, 21))
    assert not set(tokenizer.all_special_ids) & {t for r in reqs for t in r.prompt}
    same = Workload(**SMALL, seed=3).build(tokenizer)
    assert [r.prompt for r in same] == [r.prompt for r in Workload(**SMALL, seed=3).build(
        tokenizer)]


def test_shared_prefix_groups_share_exactly_the_system_prompt(tokenizer):
    reqs = shared_prefix_requests(token_pool(tokenizer), 3, 4, 30, 7, 5, random.Random(0))
    assert len(reqs) == 12 and all(r.input_len == 37 and r.output_len == 5 for r in reqs)
    for g in range(3):
        group = [r.prompt for r in reqs if r.group == g]
        assert len(group) == 4 and len({tuple(p[:30]) for p in group}) == 1
        assert len({tuple(p[30:]) for p in group}) == 4  # distinct questions
    assert len({tuple(r.prompt[:30]) for r in reqs}) == 3


def test_sharegpt_takes_the_first_human_turn_and_prunes(tokenizer, tmp_path):
    long = "word " * 2000
    data = [{"conversations": [{"from": "human", "value": f"question number {i} about things"},
                               {"from": "gpt", "value": f"an answer {i} that has some words"}]}
            for i in range(5)]
    data += [{"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": "ok"
                                                                    " then fine"}]},
             {"conversations": [{"from": "gpt", "value": "no human turn"}]},
             {"conversations": [{"from": "human", "value": "hello there friend"},
                                {"from": "gpt", "value": "x"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = Workload("sharegpt", num_prompts=5, dataset_path=str(path)).build(tokenizer)
    assert sorted(r.prompt for r in reqs) == sorted(f"question number {i} about things"
                                                    for i in range(5))
    for r in reqs:
        i = r.prompt.split()[2]
        assert r.input_len == len(tokenizer.encode(r.prompt))
        assert r.output_len == len(tokenizer.encode(f"an answer {i} that has some words",
                                                    add_special_tokens=False))
    with pytest.raises(EngineError, match="only 5 conversations fit.*--num-prompts to 5"):
        Workload("sharegpt", num_prompts=6, dataset_path=str(path)).build(tokenizer)


def test_trace_is_parsed_sorted_and_replayed_from_its_first_arrival(tokenizer, tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 12.5, "input_len": 9, "output_len": 3}\n\n'
                    '{"timestamp": 10.0, "input_len": 5, "output_len": 2}\n'
                    '{"timestamp": 11.25, "input_len": 7, "output_len": 4}\n')
    assert read_trace(str(path)) == [(10.0, 5, 2), (11.25, 7, 4), (12.5, 9, 3)]
    reqs = Workload("trace", dataset_path=str(path)).build(tokenizer)
    assert [(r.arrival, len(r.prompt), r.output_len) for r in reqs] == [
        (0.0, 5, 2), (1.25, 7, 4), (2.5, 9, 3)]
    path.write_text('{"timestamp": 1, "input_len": 0, "output_len": 2}\n')
    with pytest.raises(EngineError, match=r"trace.jsonl:1: .*input_len"):
        read_trace(str(path))
    with pytest.raises(EngineError, match="--request-rate does not apply"):
        Workload("trace", dataset_path=str(path), request_rate=2.0).validate()


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    a = poisson_arrivals(2000, 4.0, seed=7)
    assert a == poisson_arrivals(2000, 4.0, seed=7) != poisson_arrivals(2000, 4.0, seed=8)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0.0 and min(gaps) > 0 and abs(sum(gaps) / len(gaps) - 0.25) < 0.02
    assert poisson_arrivals(3, math.inf, seed=7) == [0.0, 0.0, 0.0]


# -- offline -----------------------------------------------------------------------------------
def test_offline_run_measures_every_request(engine):
    r = run_bench(engine, Workload(**SMALL))
    assert (r.completed, r.failed, r.mode) == (8, 0, "offline")
    assert r.total_output_tokens == sum(
        q.output_len for q in Workload(**SMALL).build(engine.tokenizer))
    for d in (r.ttft_ms, r.itl_ms, r.e2e_ms):
        assert 0 < d["median"] <= d["p90"] <= d["p99"]
    assert r.ttft_ms["p99"] <= r.e2e_ms["p99"]
    assert 0 < r.mean_token_usage <= r.peak_token_usage <= 1
    assert r.retractions == 0 and r.output_throughput > 0 and r.peak_in_flight == 8
    assert r.timeline[-1].output_tokens == r.total_output_tokens
    assert not engine.scheduler.has_work


def test_offline_fixed_concurrency_and_arrival_rate(engine):
    capped = run_bench(engine, Workload(**SMALL), max_concurrency=2)
    assert capped.completed == 8 and capped.peak_in_flight == 2
    assert max(s.num_running_reqs + s.num_queue_reqs for s in capped.timeline) <= 2
    paced = run_bench(engine, Workload(**SMALL, request_rate=20.0, seed=5))
    assert paced.completed == 8
    assert paced.duration_s >= poisson_arrivals(8, 20.0, seed=5)[-1]


def test_shared_prefix_offline_hits_the_cache(engine):
    r = run_bench(engine, Workload("shared-prefix", gsp_num_groups=2, gsp_prompts_per_group=3,
                                   gsp_system_prompt_len=32, gsp_question_len=4,
                                   gsp_output_len=3), max_concurrency=1)
    assert r.completed == 6 and r.cache_hit_rate > 0.5  # 4 of 6 prompts: 32 of 36 cached


def test_cli_offline_table_output_file_and_plot(model, tmp_path):
    png, out = tmp_path / "run.png", tmp_path / "runs.jsonl"
    args = ["bench", "offline", "--model", model, "--max-total-tokens", "600", "--num-prompts",
            "6", "--random-input-len", "16", "--random-output-len", "5"]
    res = CliRunner().invoke(cli, [*args, "--plot", str(png), "--output-file", str(out)])
    assert res.exit_code == 0, res.output
    assert "============ Offline Benchmark Result ============" in res.output
    for line in TABLE_LINES:
        assert line in res.output, line
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert json.loads(out.read_text())["completed"] == 6
    res = CliRunner().invoke(cli, [*args, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["completed"] == 6 and data["request_rate"] == "inf" and data["timeline"]


@pytest.mark.parametrize("extra, message", [
    (["--dataset-name", "generated-shared-prefix", "--num-prompts", "3"],
     "--num-prompts: --dataset-name generated-shared-prefix does not read it"),
    (["--dataset-name", "sharegpt"], "reads --dataset-path FILE"),
    (["--random-range-ratio", "2"], "--random-range-ratio 2.0: give a value in [0, 1]"),
])
def test_cli_refuses_flags_that_do_not_apply(model, extra, message):
    res = CliRunner().invoke(cli, ["bench", "offline", "--model", model, *extra])
    assert res.exit_code == 2 and message in res.output, res.output


def test_cli_serve_refuses_base_url_with_serve_flags():
    res = CliRunner().invoke(cli, ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--",
                                   "--max-total-tokens", "100"])
    assert res.exit_code == 2 and "with --base-url" in res.output


# -- serve -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    from engine.server.process import ServerProcess

    tmp = tmp_path_factory.mktemp("bench-serve")
    trace = tmp / "trace.jsonl"
    s = ServerProcess(["--model", model, "--max-total-tokens", "600", "--record-trace",
                       str(trace)], tmp / "server.log")
    s.wait_ready(timeout=120)
    s.trace = trace
    yield s
    s.stop()


def _trace_lines(path, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return [json.loads(x) for x in lines]
        time.sleep(0.05)
    raise AssertionError(f"{path}: {len(lines)} lines, expected {n}")


def test_serve_bench_records_a_trace_and_replays_it(server):
    w = Workload(**{**SMALL, "num_prompts": 6}, request_rate=8.0, seed=4)
    r = run_bench(server.url, w, max_concurrency=2)
    assert (r.completed, r.failed, r.mode) == (6, 0, "serve")
    assert r.peak_in_flight <= 2  # the client's own count...
    running = [s.num_running_reqs for s in r.timeline]
    assert max(running) <= 2 and all(x is not None for x in running)  # ...and the server's
    assert 0 <= r.mean_token_usage <= r.peak_token_usage <= 1
    assert r.retractions == 0 and r.cache_hit_rate is not None
    for d in (r.ttft_ms, r.itl_ms, r.e2e_ms):
        assert 0 < d["median"] <= d["p99"]
    assert "============ Serving Benchmark Result ============" in format_table(r)

    built = w.build(_tokenizer_of(server))
    rows = _trace_lines(server.trace, 6)
    assert sorted(x["input_len"] for x in rows) == sorted(q.input_len for q in built)
    assert sorted(x["output_len"] for x in rows) == sorted(q.output_len for q in built)
    t0 = min(x["timestamp"] for x in rows)
    # sent no earlier than their Poisson arrival (the concurrency cap may hold them back)
    for got, want in zip(sorted(x["timestamp"] - t0 for x in rows), [q.arrival for q in built]):
        assert got >= want - 0.1

    again = run_bench(server.url, Workload("trace", dataset_path=str(server.trace)))
    assert again.completed == 6 and again.total_input_tokens == sum(x["input_len"] for x in rows)
    assert again.total_output_tokens == sum(x["output_len"] for x in rows)
    span = max(x["timestamp"] for x in rows) - t0
    assert again.duration_s >= span - 0.05  # replayed at the recorded arrival times


def _tokenizer_of(server):
    import httpx

    from engine.bench.workloads import load_tokenizer

    return load_tokenizer(httpx.get(server.url + "/v1/models").json()["data"][0]["root"])


def test_serve_openai_backend_counts_tokens(server):
    r = run_bench(server.url, Workload(**{**SMALL, "num_prompts": 3}), backend="openai")
    assert r.completed == 3 and r.total_output_tokens == sum(
        q.output_len for q in Workload(**{**SMALL, "num_prompts": 3}).build(
            _tokenizer_of(server)))


def test_record_trace_refuses_dp_and_worker_nodes(tmp_path):
    res = CliRunner().invoke(cli, ["serve", "--record-trace", str(tmp_path / "t.jsonl"),
                                   "--dp-size", "2"])
    assert res.exit_code == 2 and "--record-trace records on a single engine server" in \
        res.output, res.output
