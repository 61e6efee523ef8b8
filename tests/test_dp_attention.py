"""`engine serve --enable-dp-attention --tp-size N` (engine/parallel/dp_attention.py): N rank
processes behind the front, each with its own requests, KV cache and scheduler and the whole
attention, the MoE layers over all of them (tokens gathered, the experts split as --tp-size /
--ep-size split them). Concurrent clients on 127.0.0.1 get exactly what one process generates,
greedy and seeded, at 2 and 4 gloo ranks, for Qwen3-MoE and DeepSeek-V3 (MLA); a rank with
nothing to run takes part in the others' forwards; what it cannot run is refused before any
process starts. Every wait is bounded (--dist-timeout, the client's timeout)."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.engine import Engine
from engine.registry import EngineError
from engine.server.process import ServerProcess
from engine_testing.checkpoints import DEEPSEEK_CASES, MOE_CASES

TIMEOUT = httpx.Timeout(120.0, connect=10.0)
PROMPTS = ["Beautiful is better than ugly. Explicit is better than implicit. Simple",
           "Flat is better than nested.", "Now", "Errors should never pass silently.",
           "Sparse is better than dense.", "Readability counts."]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 7, "ignore_eos": True}
FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048",
         "--dist-timeout", "60", "--shutdown-grace-period", "2", "--router-policy", "round_robin"]



@pytest.fixture(scope="module")
def models(tiny_model_factory):
    return {"qwen3": tiny_model_factory(MOE_CASES["qwen3_moe_mlp_only"][0],
                                        **MOE_CASES["qwen3_moe_mlp_only"][1]),
            "deepseek": tiny_model_factory(DEEPSEEK_CASES["v3_noaux_tc"][0],
                                           **DEEPSEEK_CASES["v3_noaux_tc"][1])}


@functools.lru_cache(maxsize=None)
def one_process(path: str) -> list[list[int]]:
    engine = Engine(path, device="cpu", dtype="float32", max_total_tokens=2048)
    try:
        out = engine.generate(PROMPTS * 2, [GREEDY] * len(PROMPTS) + [SEEDED] * len(PROMPTS))
        return [o["output_ids"] for o in out]
    finally:
        engine.close()


def served(path: str, tmp_path, *flags: str) -> tuple[list[list[int]], str]:
    """(the outputs of the prompts sent at once to `engine serve --enable-dp-attention
    FLAGS`, the front's log)."""
    server = ServerProcess(["--model", path, "--enable-dp-attention", *FLAGS, *flags],
                           tmp_path / "front.log")
    try:
        server.wait_ready(timeout=240)

        def ask(i: int) -> list[int]:
            params = GREEDY if i < len(PROMPTS) else SEEDED
            r = httpx.post(server.url + "/generate", timeout=TIMEOUT,
                           json={"text": PROMPTS[i % len(PROMPTS)], "sampling_params": params})
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]

        with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
            outs = list(pool.map(ask, range(2 * len(PROMPTS))))
        # a lone request: the other ranks have nothing to run and take part in its forwards
        alone = ask(0)
        assert alone == outs[0]
        replicas = httpx.get(server.url + "/get_server_info", timeout=TIMEOUT).json()["replicas"]
        ranks = [httpx.get(r["url"] + "/get_server_info", timeout=TIMEOUT).json()["dp_attention"]
                 for r in replicas]
        assert [r["rank"] for r in ranks] == list(range(len(replicas)))
        assert all(r["size"] == len(replicas) for r in ranks)
        return outs, server.log()
    finally:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.mark.parametrize("model,flags,ranks", [
    ("qwen3", ["--tp-size", "2"], 2),
    ("qwen3", ["--tp-size", "4", "--ep-size", "2"], 4),
    ("deepseek", ["--tp-size", "2", "--ep-size", "2"], 2),
], ids=["qwen3-tp2", "qwen3-tp4-ep2", "deepseek-v3-tp2-ep2"])
def test_every_rank_serves_what_one_process_generates(models, tmp_path, model, flags, ranks):
    outs, log = served(models[model], tmp_path, *flags)
    assert outs == one_process(models[model])
    for rank in range(ranks):
        assert f"dp attention: rank {rank} of {ranks} (its own requests, KV cache and " \
               f"scheduler)" in log
    assert "cuda graph: off" in log
    # round robin: every rank prefilled requests of its own
    prefilled = {line.split("]")[0] for line in log.splitlines() if "Prefill batch" in line}
    assert prefilled == {f"[dp{rank}" for rank in range(ranks)}


def test_chunked_prompts_prefix_hits_and_retraction_change_nothing(models, tmp_path):
    # prompts cut into chunks of 16, a shared prefix, and a pool of 96 tokens per rank
    # admitted at conservativeness 0.1: requests retract on the ranks
    outs, log = served(models["qwen3"], tmp_path, "--tp-size", "2", "--chunked-prefill-size",
                       "16", "--max-total-tokens", "96", "--schedule-conservativeness", "0.1",
                       "--max-running-requests", "6")
    assert outs == one_process(models["qwen3"])
    assert "decode out of memory happened, #retracted_reqs" in log


def test_an_engine_in_this_process_is_one_rank(models):
    with pytest.raises(EngineError, match="runs one process per rank.*engine serve "
                                          "--enable-dp-attention --tp-size N"):
        Engine(models["qwen3"], device="cpu", enable_dp_attention=True, tp_size=2)


@pytest.mark.parametrize("extra,message", [
    (["--tp-size", "1"], "give --tp-size 2 or more"),
    (["--tp-size", "2", "--dp-size", "3"], "--dp-size 3 with --enable-dp-attention"),
    (["--tp-size", "2", "--pp-size", "2"], "without pipeline stages"),
    (["--tp-size", "2", "--enable-overlap-schedule"], "not yet with --enable-torch-compile"),
    (["--tp-size", "2", "--speculative-algorithm", "NGRAM"], "speculative decoding"),
    (["--tp-size", "4", "--ep-size", "3"], "--ep-size 3 must divide --tp-size 4"),
])
def test_what_it_cannot_run_is_refused_before_any_rank_starts(models, extra, message):
    from click.testing import CliRunner
    from engine_cli.main import cli

    result = CliRunner().invoke(cli, ["serve", "--model", models["qwen3"], "--device", "cpu",
                                      "--enable-dp-attention", *extra])
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_dense_model_is_refused(tiny_model_factory):
    from click.testing import CliRunner
    from engine_cli.main import cli

    result = CliRunner().invoke(cli, ["serve", "--model", tiny_model_factory("llama"),
                                      "--device", "cpu", "--enable-dp-attention",
                                      "--tp-size", "2"])
    assert result.exit_code == 2 and "for mixture-of-experts models" in result.output and \
        "--dp-size 2 replicas instead" in result.output, result.output


@pytest.mark.parametrize("kwargs", [{"dp_attention_rank": 0, "dp_attention_size": 2},
                                    {"dp_attention_init": "tcp://127.0.0.1:1"},
                                    {"dp_attention_size": 2}])
def test_a_ranks_own_flags_are_the_fronts_to_give(kwargs):
    from engine.config import EngineConfig

    with pytest.raises(EngineError, match="set by `engine serve --enable-dp-attention`"):
        EngineConfig(**kwargs).validate()


def test_a_killed_rank_ends_in_clear_errors_not_a_hang(models, tmp_path):
    """Every rank takes part in every forward, so a rank killed while serving cannot be
    restarted into the others' process group: it is reported and not restarted, the surviving
    rank says why it cannot serve, the front's /health is 503 and a new request gets a 503
    naming the cause; each within bounded time."""
    import os
    import signal
    import time

    server = ServerProcess(["--model", models["qwen3"], "--enable-dp-attention", *FLAGS,
                            "--tp-size", "2", "--dist-timeout", "20"], tmp_path / "front.log")
    try:
        server.wait_ready(timeout=240)
        r = httpx.post(server.url + "/generate", timeout=TIMEOUT,
                       json={"text": PROMPTS[0], "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        replicas = httpx.get(server.url + "/get_server_info", timeout=TIMEOUT).json()["replicas"]
        os.kill(replicas[1]["pid"], signal.SIGKILL)
        deadline, health = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            health = httpx.get(server.url + "/health", timeout=TIMEOUT)
            if health.status_code == 503:
                break
            time.sleep(0.5)
        assert health is not None and health.status_code == 503, health.text
        assert "dp attention rank 1 is gone (process" in health.text
        assert "killed by SIGKILL" in health.text and "restart `engine serve`" in health.text
        r = httpx.post(server.url + "/generate", timeout=TIMEOUT,
                       json={"text": PROMPTS[1], "sampling_params": GREEDY})
        assert r.status_code == 503 and "dp attention rank 1 is gone" in r.text, r.text
        survivor = httpx.get(replicas[0]["url"] + "/health", timeout=TIMEOUT)
        assert survivor.status_code == 503
        assert "another data-parallel attention rank is gone" in survivor.text
    finally:
        server.stop()
    log = server.log()
    assert "the engine cannot serve: dp attention rank 1 is gone" in log, log[-3000:]
    assert "restarting it" not in log
