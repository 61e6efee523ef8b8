"""The overlap scheduler (--enable-overlap-schedule): the same outputs as the synchronous one
(greedy, seeded, penalties, stops, retraction, chunked prefill, grammar, aborts), the KV
invariant after every run, the flags, and a real `engine serve` with it on."""

import json
import logging
import os
import random
import sys
import time

import httpx
import pytest

from engine import Engine
from engine.config import ConfigError
from engine_testing.invariants import assert_all_free
from engine.interfaces import Constraint
from engine.server.process import ServerProcess

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
sys.path.insert(0, FIXTURES)
import engine_grammar_toy as toy  # noqa: E402

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def ids(seed, n, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def make(model, overlap: bool, **kw):
    return Engine(model, **{"max_total_tokens": 4000, "enable_overlap_schedule": overlap, **kw})


def both(model, prompts, params, **kw):
    """Outputs (ids, finish reason, number of logprobs) of a synchronous and an overlapped
    engine, and the latter."""
    results, engines = [], []
    for overlap in (False, True):
        engine = make(model, overlap, **kw)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        engine.scheduler.check_invariants()
        results.append([(o["output_ids"], o["meta_info"]["finish_reason"],
                         len(o["meta_info"].get("output_token_logprobs", []))) for o in outs])
        engines.append(engine)
    engines[1].step()  # collects the last in-flight batch (all its rows discarded)
    assert engines[1].scheduler.overlap.inflight is None
    assert_all_free(engines[1])
    engines[1].close()
    return results[0], results[1], engines[1]


def test_launching_ahead_gives_the_same_outputs(model, monkeypatch):
    """What a GPU does (the next forward queued before this batch's tokens are read back),
    forced on the CPU: greedy with logprobs, seeded n > 1 with penalties, stops and prompts
    of several chunks give the synchronous scheduler's outputs, and batches did go ahead."""
    monkeypatch.setenv("ENGINE_OVERLAP_LAUNCH_AHEAD", "1")
    prompts = [ids(40 + i, 5 + 9 * i) for i in range(6)]
    params = [{**GREEDY, "max_new_tokens": 6 + 4 * i, "logprobs": i % 2 == 1,
               "top_logprobs": 2 * (i % 2)}
              if i % 3 else
              {"temperature": 0.9, "seed": i, "n": 2, "frequency_penalty": 0.5,
               "max_new_tokens": 14, "ignore_eos": True, "stop_token_ids": [7]}
              for i in range(6)]
    sync, overlap, engine = both(model, prompts, params, chunked_prefill_size=16)
    assert overlap == sync
    assert engine.scheduler.overlap.launch_ahead
    assert engine.scheduler.overlap.launched_ahead >= 5


def test_greedy_outputs_and_logprobs_are_identical(model):
    prompts = [ids(i, 5 + 3 * i) for i in range(6)]
    params = [{**GREEDY, "max_new_tokens": 4 + 5 * i, "logprobs": i % 2 == 1,
               "top_logprobs": 2 * (i % 2)}
              for i in range(6)]  # they finish mid-batch
    sync, overlap, engine = both(model, prompts, params)
    assert overlap == sync
    assert [len(o) for o, _, _ in overlap] == [4 + 5 * i for i in range(6)]
    assert [n for _, _, n in overlap] == [(4 + 5 * i) * (i % 2) for i in range(6)]  # logprobs
    assert engine.scheduler.counters.generation_tokens == sum(4 + 5 * i for i in range(6))


def test_seeded_sampling_with_n_and_penalties_are_identical(model):
    prompts = [ids(20 + i, 12) for i in range(3)]
    params = [{"temperature": 0.9, "top_p": 0.9, "seed": 5, "n": 3, "max_new_tokens": 16,
               "ignore_eos": True},
              {"temperature": 0.7, "seed": 8, "repetition_penalty": 1.3, "max_new_tokens": 20,
               "ignore_eos": True},
              {"temperature": 0, "frequency_penalty": 0.8, "presence_penalty": 0.4,
               "max_new_tokens": 12, "ignore_eos": True}]
    sync, overlap, _ = both(model, prompts, params)
    assert len(overlap) == 5 and overlap == sync
    assert len({tuple(o) for o, _, _ in overlap[:3]}) > 1  # n=3: three different samples


def test_batch_n_plus_1_is_built_before_batch_n_is_committed(model):
    events = []
    for overlap in (False, True):
        engine = make(model, overlap)
        s = engine.scheduler
        build, commit = s.forward_batch, s.commit
        s.forward_batch = lambda *a: events.append("B") or build(*a)
        s.commit = lambda *a: events.append("C") or commit(*a)
        engine.generate(input_ids=[ids(1, 6), ids(2, 9)],
                        sampling_params={**GREEDY, "max_new_tokens": 5})
        events.append("|")
        engine.close()
    sync, overlapped = "".join(events).split("|")[:2]
    assert sync == "BC" * 5
    # batch k+1 is built before batch k's tokens are committed; none is built for a token that
    # is known to be the last (max_new_tokens)
    assert overlapped == "B" + "BC" * 4 + "C"


def test_sampling_waits_for_the_previous_tokens_even_when_committing_is_slow(model):
    """Penalties must see the token sampled one batch earlier: the worker samples batch N+1
    only after the scheduler has committed batch N, however long that takes."""
    prompts = [ids(30 + i, 8) for i in range(3)]
    params = {"temperature": 0, "repetition_penalty": 2.0, "frequency_penalty": 1.5,
              "max_new_tokens": 16, "ignore_eos": True}
    sync = make(model, False).generate(input_ids=prompts, sampling_params=params)
    engine = make(model, True)
    commit = engine.scheduler.commit

    def slow_commit(*args):
        time.sleep(0.05)
        return commit(*args)

    engine.scheduler.commit = slow_commit
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    engine.close()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in sync]


def test_stop_token_ids_and_stop_strings_finish_mid_batch_identically(model):
    prompts = [ids(40 + i, 10) for i in range(4)]
    reference = make(model, False).generate(
        input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 24})
    stop_id = reference[0]["output_ids"][5]  # ends request 0 (at least) early
    text = reference[1]["text"]
    stop_str = text[len(text) // 3: len(text) // 3 + 2]
    params = [{"temperature": 0, "max_new_tokens": 24, "stop_token_ids": [stop_id]},
              {"temperature": 0, "max_new_tokens": 24, "stop": [stop_str]},
              {"temperature": 0, "max_new_tokens": 24, "stop_token_ids": [stop_id]},
              {**GREEDY, "max_new_tokens": 24}]
    sync, overlap, _ = both(model, prompts, params)
    assert overlap == sync
    assert overlap[0][1]["type"] == "stop" and len(overlap[0][0]) <= 6
    assert overlap[1][1] == {"type": "stop", "matched": stop_str}


def test_a_retraction_storm_gives_identical_outputs(model, caplog):
    prompts = [ids(i, 20 + i) for i in range(8)]
    params = {**GREEDY, "max_new_tokens": 40}
    with caplog.at_level(logging.WARNING, logger="engine"):
        sync, overlap, engine = both(model, prompts, params, max_total_tokens=160,
                                     schedule_conservativeness=0.1)
    assert engine.scheduler.counters.retracted_reqs >= 1
    assert overlap == sync
    reference = make(model, False).generate(input_ids=prompts, sampling_params=params)
    assert [o for o, _, _ in overlap] == [r["output_ids"] for r in reference]


def test_chunked_prefill_of_long_prompts_is_identical(model):
    prompts = [ids(7, 150), ids(8, 5), ids(9, 90)]
    params = [{**GREEDY, "max_new_tokens": 12}, {"temperature": 0.8, "seed": 2,
                                                 "max_new_tokens": 30, "ignore_eos": True},
              {**GREEDY, "max_new_tokens": 7}]
    sync, overlap, _ = both(model, prompts, params, chunked_prefill_size=16)
    assert overlap == sync
    unchunked = make(model, False, chunked_prefill_size=-1).generate(input_ids=prompts[0],
                                                                     sampling_params=params[0])
    assert overlap[0][0] == unchunked["output_ids"]


def test_a_grammar_constrained_request_next_to_free_ones_is_identical(model):
    choice = Constraint("choice", json.dumps(["blue", "green", "maybe later"]), "guided_choice")
    outs = []
    with toy.registered_globally(toy, "toy_grammar"):
        for overlap in (False, True):
            engine = make(model, overlap, max_total_tokens=500, grammar_backend="toy_choice")
            reqs = (engine.add_request("hello there", {"temperature": 0.9, "seed": 4, "n": 3,
                                                       "max_new_tokens": 40}, constraint=choice)
                    + engine.add_request("import sys", {"temperature": 0.8, "seed": 11,
                                                        "max_new_tokens": 15,
                                                        "ignore_eos": True})
                    + engine.add_request([5, 6, 7], {**GREEDY, "max_new_tokens": 9}))
            for _ in range(400):
                if all(r.finished for r in reqs):
                    break
                engine.step()
            outs.append([engine.output(r) for r in reqs])
            engine.step()
            assert_all_free(engine)
            engine.close()
    assert [o["output_ids"] for o in outs[1]] == [o["output_ids"] for o in outs[0]]
    assert all(o["text"] in ("blue", "green", "maybe later") for o in outs[1][:3])
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs[1][:3])


def test_an_abort_in_flight_drops_its_token_and_frees_its_slots(model):
    engine = make(model, True, page_size=4)
    s = engine.scheduler
    reqs = [engine.add_request(ids(i, 6 + i), {**GREEDY, "max_new_tokens": 12})[0]
            for i in range(5)]
    engine.step()  # the prefill is submitted; nothing sampled yet
    engine.step()  # its tokens come back; the first decode batch is in flight
    assert s.overlap.inflight is not None and reqs[0] in s.overlap.inflight.reqs
    before = len(reqs[0].output_ids)
    engine.abort(reqs[0])
    s.check_invariants()
    while s.has_work:
        engine.step()
        s.check_invariants()
    assert reqs[0].finish_reason == "abort" and len(reqs[0].output_ids) == before
    alone = make(model, False).generate(input_ids=[ids(i, 6 + i) for i in range(1, 5)],
                                        sampling_params={**GREEDY, "max_new_tokens": 12})
    assert [r.output_ids for r in reqs[1:]] == [o["output_ids"] for o in alone]
    engine.step()
    assert_all_free(engine)
    engine.close()


def test_the_flags_spellings_and_the_conflict(model, tmp_path):
    from click.testing import CliRunner
    from engine_cli.main import cli

    assert make(model, False).scheduler.overlap is None
    with pytest.raises(ConfigError, match="--enable-overlap-schedule and "
                                          "--disable-overlap-schedule contradict"):
        Engine(model, enable_overlap_schedule=True, disable_overlap_schedule=True)
    with pytest.raises(ConfigError, match="--enable-overlap-schedule with --tp-size"):
        Engine(model, enable_overlap_schedule=True, tp_size=2)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "input_ids": [5, 6, 7]}\n')
    base = ["generate", "--model", model, "--input", str(inp), "--max-total-tokens", "500",
            "--temperature", "0", "--max-new-tokens", "5"]
    runs = {}
    for flag in ("--disable-overlap-schedule", "--enable-overlap-schedule",
                 "--enable-overlap-scheduler"):
        out = tmp_path / f"{flag}.jsonl"
        result = CliRunner().invoke(cli, [*base, "--output", str(out), flag])
        assert result.exit_code == 0, result.output
        runs[flag] = json.loads(out.read_text())["output_ids"]
    assert len(set(map(tuple, runs.values()))) == 1 and len(runs[flag]) == 5
    result = CliRunner().invoke(cli, [*base, "--output", str(tmp_path / "x.jsonl"),
                                      "--enable-overlap-schedule", "--disable-overlap-schedule"])
    assert result.exit_code != 0 and "contradict each other" in result.output


def test_engine_serve_with_overlap_schedule(model, tmp_path):
    prompts = ["Hello there", "The quick brown fox", "import sys"]
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    reference = make(model, False).generate(prompts, params)
    server = ServerProcess(["--model", model, "--max-total-tokens", "500",
                            "--enable-overlap-schedule"], tmp_path / "serve.log")
    try:
        server.wait_ready(120)
        r = httpx.post(server.url + "/generate", json={"text": prompts, "sampling_params": params},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == [o["output_ids"] for o in reference]
    finally:
        server.stop()
    assert "overlap schedule: on" in server.log()


def test_a_failed_forward_reaches_step_and_the_engine_goes_on(model):
    engine = make(model, True)
    s = engine.scheduler
    forward, calls = engine.runner.forward, []

    def failing(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return forward(batch)

    engine.runner.forward = failing
    reqs = engine.add_request(ids(3, 7), {**GREEDY, "max_new_tokens": 10})
    with pytest.raises(RuntimeError, match="boom"):
        for _ in range(10):
            engine.step()
    assert s.overlap.inflight is None  # the batch submitted after the failed one was dropped
    # the batch after the failed one was built on its results: its requests fail, nothing of
    # them stays cached
    assert reqs[0].finish_reason == "error" and "RuntimeError: boom" in reqs[0].error
    assert_all_free(engine)
    out = engine.generate(input_ids=ids(4, 7), sampling_params={**GREEDY, "max_new_tokens": 6})
    assert out["output_ids"] == make(model, False).generate(
        input_ids=ids(4, 7), sampling_params={**GREEDY, "max_new_tokens": 6})["output_ids"]
    engine.close()
