"""--tp-size / --pp-size through the Engine: rank 0 in this process runs the scheduler, the other
ranks are worker processes it starts (gloo). Each case generates with the same scheduler
settings as a one-process engine and must produce the same tokens, greedy and seeded, with
chunked prefill, prefix-cache hits and retraction in the mix; ENGINE_PARALLEL_CHECK makes every
worker compare its copy of the request table with rank 0's at every forward. Every wait is
bounded (--dist-timeout), and each engine is closed (its workers stopped) before the next."""

from __future__ import annotations

import logging

import pytest

from engine.engine import Engine
from engine.registry import EngineError

SHARED = "Beautiful is better than ugly. Explicit is better than implicit. "
PROMPTS = [SHARED + "Simple", SHARED + "Flat is better", "Now", "Errors should never pass silently."]
GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": 7, "ignore_eos": True}
# small pools and chunks: prompts are chunked, the shared prefix is cached, requests retract
BASE = dict(device="cpu", dtype="float32", attention_backend="torch_native", seed=3,
            chunked_prefill_size=16, max_running_requests=6, schedule_conservativeness=0.1,
            dist_timeout=60)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from engine_testing.checkpoints import make_tiny_model

    root = tmp_path_factory.mktemp("parallel")
    return {
        # 1 KV head < 2 ranks (replicated), a vocabulary of 511 that does not split evenly,
        # a tied head, qkv biases
        "qwen2_gqa": make_tiny_model(str(root / "qwen2"), "Qwen2ForCausalLM",
                                     num_key_value_heads=1, vocab_size=511,
                                     tie_word_embeddings=True),
        # 3 layers: stages of 2 and 1
        "llama3": make_tiny_model(str(root / "llama3"), "LlamaForCausalLM",
                                  num_hidden_layers=3),
    }


def generate(path: str, **kwargs) -> tuple[list[list[int]], int, object]:
    engine = Engine(path, **BASE, **kwargs)
    try:
        out = engine.generate(PROMPTS * 2, [GREEDY] * len(PROMPTS) + [SEEDED] * len(PROMPTS))
        return ([o["output_ids"] for o in out], engine.scheduler.counters.retracted_reqs,
                engine.sizing)
    finally:
        engine.close()


@pytest.fixture(autouse=True)
def check_tables(monkeypatch):
    monkeypatch.setenv("ENGINE_PARALLEL_CHECK", "1")


@pytest.mark.parametrize("case,parallel,pool", [
    ("qwen2_gqa", {"tp_size": 2}, 120),
    ("llama3", {"pp_size": 2}, 120),
    ("qwen2_gqa", {"tp_size": 2, "pp_size": 2}, 4096),
])
def test_parallel_generates_what_one_process_does(models, case, parallel, pool):
    """120 KV slots for 8 requests of up to 24 prompt + 24 new tokens, admitted with
    --schedule-conservativeness 0.1: they run out of room and retract; the same scheduler on rank 0 makes the same decisions, so the tokens must
    match exactly (float32 logits differ from one process's by reduction order only)."""
    ref, retracted, _ = generate(models[case], max_total_tokens=pool)
    got, retracted_too, sizing = generate(models[case], max_total_tokens=pool, **parallel)
    assert got == ref
    assert retracted_too == retracted and (retracted > 0 or pool > 1000)
    assert sizing.max_total_tokens == pool


def test_the_log_and_info_describe_the_ranks(models, caplog):
    caplog.set_level(logging.INFO, logger="engine")
    engine = Engine(models["llama3"], **BASE, pp_size=2, max_total_tokens=256)
    try:
        info = engine.runner.info()
        assert [r["pp_rank"] for r in info["ranks"]] == [0, 1]
        assert info["backend"] == "gloo" and info["failure"] is None
        # 3 layers: stage 0 holds the embedding and 2 layers, stage 1 one layer, the norm and
        # the head (vLLM's and SGLang's split: the last stage gets no extra layer)
        w0, w1 = (r["weight_bytes"] for r in info["ranks"])
        kv0, kv1 = (r["kv_bytes_per_token"] for r in info["ranks"])
        assert kv0 == 2 * kv1
        assert w0 != w1
        assert engine.sizing.kv_bytes_per_token == kv0  # the pool is sized for the larger
    finally:
        engine.close()
    assert "parallel: tp_size=1, pp_size=2, nnodes=1: 2 ranks over gloo" in caplog.text
    assert "rank 1 (pp 1)" in caplog.text


@pytest.mark.parametrize("kwargs,match", [
    ({"tp_size": 3}, "4 attention heads do not split over 3 ranks"),
    ({"pp_size": 5, "model": "llama3"}, "3 layers cannot be split over 5"),
    ({"tp_size": 2, "nnodes": 2}, "--nnodes 2 needs --dist-init-addr"),
    ({"tp_size": 2, "nnodes": 3, "dist_init_addr": "127.0.0.1:1"}, "does not divide the 2 ranks"),
    ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "127.0.0.1:1"},
     "--node-rank 2 is outside 0..1"),
    ({"tp_size": 2, "dist_init_addr": "nohost"}, "--dist-init-addr must be host:port"),
    ({"tp_size": 2, "parallel_strategy": "nccl"}, "'nccl' cannot run here: needs CUDA GPUs"),
    ({"tp_size": 2, "enable_torch_compile": True}, "--enable-torch-compile with --tp-size"),
])
def test_bad_layouts_are_refused_before_any_process_starts(models, kwargs, match):
    model = models[kwargs.pop("model", "qwen2_gqa")]
    with pytest.raises(EngineError, match=match):
        Engine(model, **{**BASE, **kwargs})


# (before the failed join below: a tp engine started in a process after a failed join
# does not join today, a known defect noted for the next round)
@pytest.mark.parametrize("when", ["after", "before"])
def test_a_failure_in_rank_0s_forward_fails_the_batch_not_the_engine(models, when):
    """Rank 0's part of a forward raises (say, out of memory for its logits). If the workers
    finished that forward, the group is in step: the error is the batch's, and the engine goes
    on as one process would. If rank 0 raised before its collectives, the workers wait in one
    rank 0 left: that is fatal, and said so."""
    from engine.ranks.executor import RankFailed

    engine = Engine(models["qwen2_gqa"], **BASE, tp_size=2, max_total_tokens=4096)
    try:
        forward, calls = engine.runner.inner.forward, []

        def failing(batch, return_all_logits=False, **kw):
            calls.append(1)
            if len(calls) == 2:
                if when == "before":
                    raise RuntimeError("out of memory (injected before the collectives)")
                forward(batch, return_all_logits, **kw)
                raise RuntimeError("out of memory (injected after the collectives)")
            return forward(batch, return_all_logits, **kw)

        engine.runner.inner.forward = failing
        reqs = engine.add_request(PROMPTS[0], GREEDY)
        engine.step()
        if when == "before":
            with pytest.raises(RankFailed, match="cannot serve"):
                engine.step()
            assert engine.failure
            return
        with pytest.raises(RuntimeError, match="injected after"):
            engine.step()
        assert engine.failure is None
        for r in reqs:
            engine.abort(r)
        engine.runner.inner.forward = forward
        got = engine.generate(PROMPTS, GREEDY)
    finally:
        engine.close()
    ref = Engine(models["qwen2_gqa"], **BASE, max_total_tokens=4096).generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]


def test_a_worker_that_cannot_join_is_named_at_once(models, monkeypatch, tmp_path):
    """A local rank that dies before joining ends the start as soon as it exits, naming it
    (not after --dist-timeout); a tp engine started in the same process afterwards joins its
    ranks (the join given up on once counted a process group: torch's numbering is started
    over, else the new group's name matched no worker's)."""
    import time

    from engine.ranks import launch

    script = tmp_path / "dies.py"
    script.write_text("import sys\nsys.exit(3)\n")
    with monkeypatch.context() as m:
        m.setattr(launch, "WORKER_COMMAND", [str(script)])
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"rank 0 \(tp 0\) could not join the 2 ranks' "
                                              r"gloo group within --dist-timeout 15 s: rank 1 "
                                              r"\(tp 1\) exited with code 3"):
            Engine(models["qwen2_gqa"], **{**BASE, "dist_timeout": 15}, tp_size=2)
        assert time.monotonic() - start < 12
    engine = Engine(models["qwen2_gqa"], **BASE, tp_size=2)
    try:
        assert engine.generate(PROMPTS[:1], GREEDY)[0]["output_ids"]
    finally:
        engine.close()
