"""Piecewise CUDA graphs (core/engine/piecewise_cuda_graph.py): on a CPU with the EagerGraph
stand-in, prompt, mixed and decode batches give the eager forward's logits through the pieces
(padding included) and greedy tokens equal HF's; the flags, the sizing's room for them, the
start lines; the real capture on a CUDA GPU (skipped without one)."""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from engine.config import ConfigError, EngineConfig
from engine.device import DeviceInfo
from engine.errors import EngineError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.interfaces import GraphUnsupported
from engine.memory.sizing import plan
from engine.piecewise_cuda_graph import (capture_piecewise_graphs, capture_sizes,
                                         estimate_piecewise_bytes)
from engine.runner import ModelRunner
from engine_cli.main import cli
from engine_testing.checkpoints import TINY_CASES
from engine_testing.generation import ZEN, greedy_generate
from engine_testing.graphs import EagerGraph

GIB = 1 << 30
H100 = DeviceInfo("cuda", "NVIDIA H100", (9, 0), 80 * GIB, 79 * GIB, True)
MAX_TOKENS = 64  # sizes 4, 8, 12, 16, 24, 32, 48, 64


def test_capture_sizes_ladder_ends_at_max_tokens():
    sizes = capture_sizes(4096)
    assert sizes[:15] == [4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256]
    assert sizes[15:] == [320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048,
                          2560, 3072, 3584, 4096] and len(sizes) == 31
    assert capture_sizes(64) == [4, 8, 12, 16, 24, 32, 48, 64]
    assert capture_sizes(100) == [4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 100]
    assert capture_sizes(1) == [1]
    assert capture_sizes(6000)[-3:] == [4096, 5120, 6000]


def cpu_runner(path, registries) -> ModelRunner:
    runner = ModelRunner(path, registries=registries, device=DeviceInfo("cpu", "CPU"),
                         dtype="float32")
    runner.init_kv_pool(2048)
    return runner


def runner_with_pieces(path, registries) -> ModelRunner:
    runner = cpu_runner(path, registries)
    runner.init_piecewise_cuda_graphs(MAX_TOKENS, graph_cls=EagerGraph)
    return runner


def eager_logits(runner, batch, return_all_logits):
    pieces, runner.piecewise_graphs = runner.piecewise_graphs, None
    try:
        return runner.forward(batch, return_all_logits)
    finally:
        runner.piecewise_graphs = pieces


def assert_pieces_match_eager(runner, batch, tolerance=1e-5):
    """Both logit shapes through the pieces equal the eager forward's (which writes the same
    K/V into the same slots, so running both is harmless)."""
    for return_all in (False, True):
        before = runner.piecewise_graphs.replays
        ours = runner.forward(batch, return_all)
        assert runner.last_piecewise_graph and runner.piecewise_graphs.replays == before + 1
        ref = eager_logits(runner, batch, return_all)
        assert not runner.last_piecewise_graph
        assert ours.shape == ref.shape == (batch.num_tokens if return_all else batch.batch_size,
                                           runner.model_config.vocab_size)
        assert ours.dtype == torch.float32
        assert (ours - ref).abs().max() <= tolerance * ref.abs().max()


def batch_of(pool, rows, new, prefix):
    locs = [pool.extend_slots(r, n, len(x)) for r, n, x in zip(rows, prefix, new)]
    return ForwardBatch.build(new, prefix, rows, torch.cat(locs), pool.req_to_token,
                              device=pool.device)


@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_extend_mixed_and_decode_batches_equal_the_eager_forward(
        case, tiny_model_factory, registries, single_torch_thread):
    runner = runner_with_pieces(tiny_model_factory(case), registries)
    pieces, pool = runner.piecewise_graphs, runner.kv_pool
    assert pieces.sizes == [4, 8, 12, 16, 24, 32, 48, 64] and pieces.num_pieces == 3
    addresses = [t.data_ptr() for t in (pieces.h, pieces.q, pieces.k, pieces.v, pieces.attn_out)]
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(3, runner.model_config.vocab_size, (n,), generator=g).tolist()

    rows = [pool.alloc_req() for _ in range(4)]
    # three prompts together: 27 tokens, padded to 32
    extend = batch_of(pool, rows[:3], [ids(5), ids(9), ids(13)], [0, 0, 0])
    assert extend.mode == ForwardMode.EXTEND and extend.num_tokens == 27
    assert_pieces_match_eager(runner, extend)
    # a prompt's next chunk after its cached 5 tokens next to two decodes: 9 tokens, padded
    # to 12; then a fourth prompt after the first one's 12 tokens as its cached prefix
    mixed = batch_of(pool, rows[:3], [ids(7), ids(1), ids(1)], [5, 9, 13])
    assert mixed.mode == ForwardMode.MIXED and mixed.num_tokens == 9
    assert_pieces_match_eager(runner, mixed)
    pool.req_to_token[rows[3], :12] = pool.req_to_token[rows[0], :12]
    shared = batch_of(pool, rows, [ids(1), ids(1), ids(1), ids(6)], [12, 10, 14, 12])
    assert shared.mode == ForwardMode.MIXED
    assert_pieces_match_eager(runner, shared)
    # a decode batch: no decode graphs here, so the pieces serve it (3 rows, padded to 4)
    decode = batch_of(pool, rows[:3], [ids(1), ids(1), ids(1)], [13, 11, 15])
    assert decode.mode == ForwardMode.DECODE
    assert_pieces_match_eager(runner, decode)
    assert [t.data_ptr() for t in (pieces.h, pieces.q, pieces.k, pieces.v,
                                   pieces.attn_out)] == addresses
    # with decode graphs, the decode batches they take go there (all logits: not theirs)
    runner.cuda_graphs = SimpleNamespace(can_run=lambda batch: batch.batch_size <= 3)
    assert not pieces.can_run(decode) and pieces.can_run(decode, return_all_logits=True)
    assert pieces.can_run(shared)
    runner.cuda_graphs = None
    # above the largest size: eager, no replay
    before = pieces.replays
    big = batch_of(pool, rows[:1], [ids(MAX_TOKENS + 1)], [14])
    runner.forward(big)
    assert not runner.last_piecewise_graph and pieces.replays == before


@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_greedy_tokens_equal_hf_with_the_pieces_serving_every_step(
        case, tiny_model_factory, registries, single_torch_thread):
    import transformers

    path = tiny_model_factory(case)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [tok(t).input_ids for t in ZEN]
    assert sum(map(len, prompts)) <= MAX_TOKENS
    runner = runner_with_pieces(path, registries)
    steps = 8
    ours = greedy_generate(runner, prompts, steps)
    for p, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False,
                          pad_token_id=2)
        assert out == ref[0, len(p):].tolist()
    # the prompt step and every decode step (no decode graphs here) replayed the pieces
    assert runner.piecewise_graphs.replays == steps and runner.last_piecewise_graph


def fake_cuda_memory(used=0):
    @contextmanager
    def measure():
        info = {"before": 40 * GIB}
        yield info
        info.update(used=used, free=40 * GIB - used)

    return measure


def test_start_line_on_a_gpu_and_why_not(tiny_model_factory, registries, monkeypatch):
    """capture_piecewise_graphs as a GPU start runs it (the CUDA memory readings faked, the
    graphs EagerGraph); and what it says or raises when it cannot."""
    import engine.cuda_graph

    runner = cpu_runner(tiny_model_factory("llama"), registries)
    monkeypatch.setattr(engine.cuda_graph, "measure_cuda_memory", fake_cuda_memory(430 << 20))
    real_init = runner.init_piecewise_cuda_graphs
    monkeypatch.setattr(runner, "init_piecewise_cuda_graphs",
                        functools.partial(real_init, graph_cls=EagerGraph))
    on = EngineConfig(enable_piecewise_cuda_graph=True)
    sizing = SimpleNamespace(piecewise_cuda_graph_max_tokens=64, mem_fraction_static=0.8)
    line = capture_piecewise_graphs(runner, on, H100, sizing)
    assert line.startswith("piecewise cuda graph: on, 8 token sizes up to 64, 3 pieces each "
                           "(attention eager between them), captured in ")
    assert line.endswith(" s, mem usage=0.42 GB")
    pieces = runner.piecewise_graphs
    assert pieces.max_tokens == 64
    held = sum(t.numel() * t.element_size() for t in (
        pieces.input_ids, pieces.positions, pieces.h, pieces.cos, pieces.sin, pieces.q, pieces.k,
        pieces.v, pieces.attn_out))
    assert held < estimate_piecewise_bytes(runner.model_config, 4, 64) - (64 << 20)

    def off(config, device=H100):
        return capture_piecewise_graphs(runner, config, device, sizing)

    assert off(EngineConfig()) == ("piecewise cuda graph: off (not enabled: "
                                   "--enable-piecewise-cuda-graph turns it on)")
    assert off(EngineConfig(disable_piecewise_cuda_graph=True)) == (
        "piecewise cuda graph: off (--disable-piecewise-cuda-graph)")
    assert off(on, DeviceInfo("cpu", "CPU")) == (
        "piecewise cuda graph: off (needs a CUDA GPU; on a CPU the decode steps run as CPU "
        "graphs)")
    assert off(EngineConfig(enable_piecewise_cuda_graph=True, tp_size=2)).startswith(
        "piecewise cuda graph: off (--tp-size/--pp-size > 1")
    runner.model.tp = object()  # as a tp rank's model holds its group
    assert off(on).startswith("piecewise cuda graph: off (tensor- or pipeline-parallel layers")
    with pytest.raises(GraphUnsupported, match="the piecewise parts are the single-process"):
        runner.model.piecewise_parts()
    runner.model.tp = None
    monkeypatch.setattr(runner, "model", SimpleNamespace())
    assert off(on) == "piecewise cuda graph: off (SimpleNamespace has no piecewise_parts())"

    def out_of_memory(max_tokens):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(runner, "init_piecewise_cuda_graphs", out_of_memory)
    with pytest.raises(EngineError, match="lower --piecewise-cuda-graph-max-tokens or "
                                          r"--mem-fraction-static \(now 0.8\)"):
        off(on)


def test_sizing_leaves_room_for_the_pieces():
    class Config:
        hidden_size, intermediate_size, vocab_size = 4096, 14336, 128256
        num_heads, num_kv_heads, head_dim = 32, 8, 128

    per_token = estimate_piecewise_bytes(Config, 2, 2) - estimate_piecewise_bytes(Config, 2, 1)
    assert per_token == (4096 * 5 + 2 * 128 + 3 * 14336 + 3 * 4096 + 4 * 1024) * 2 + 16

    def report(device=H100, **kw):
        return plan(EngineConfig(disable_cuda_graph=True, **kw), device, 16 * GIB, 128 << 10,
                    "auto", 8192, piecewise_bytes=lambda n: n * (1 << 20))

    on = report(enable_piecewise_cuda_graph=True)
    assert on.piecewise_cuda_graph_max_tokens == 4096
    assert on.piecewise_cuda_graph_reserve_bytes == 4 * GIB
    assert on.mem_fraction_static == 0.88  # 4 of the 80 GiB fit in the 12% left
    assert ("piecewise cuda graph: batches up to 4096 tokens, about 4.00 GiB expected outside "
            "mem_fraction_static (which leaves 9.60 GiB)") in on.lines()
    more = report(enable_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=16384,
                  chunked_prefill_size=-1, max_prefill_tokens=12288)
    assert more.piecewise_cuda_graph_max_tokens == 12288  # capped by the prompt tokens a step
    assert more.mem_fraction_static == 0.85  # lowered to leave the 12 GiB outside
    assert report(enable_piecewise_cuda_graph=True,
                  chunked_prefill_size=1024).piecewise_cuda_graph_max_tokens == 1024
    tight = report(enable_piecewise_cuda_graph=True, mem_fraction_static=0.97)
    assert ("warning: that may not fit: lower --mem-fraction-static or "
            "--piecewise-cuda-graph-max-tokens (or run without --enable-piecewise-cuda-graph)"
            ) in tight.lines()
    for off in (report(), report(DeviceInfo("cpu", "CPU", None, 8 * GIB, 64 * GIB),
                                 enable_piecewise_cuda_graph=True),
                report(enable_piecewise_cuda_graph=True, pp_size=2)):
        assert off.piecewise_cuda_graph_max_tokens == 0
        assert off.piecewise_cuda_graph_reserve_bytes == 0
        assert not any(x.startswith("piecewise") for x in off.lines())


def test_flags_parse_and_contradictions_are_refused():
    out = CliRunner().invoke(cli, ["serve", "--help"]).output
    for flag in ("--enable-piecewise-cuda-graph", "--disable-piecewise-cuda-graph",
                 "--piecewise-cuda-graph-max-tokens"):
        assert flag in out
    config = EngineConfig().validate()
    assert not config.enable_piecewise_cuda_graph and config.piecewise_cuda_graph_max_tokens == 4096
    with pytest.raises(ConfigError, match="--enable-piecewise-cuda-graph and "
                                          "--disable-piecewise-cuda-graph contradict"):
        EngineConfig(enable_piecewise_cuda_graph=True,
                     disable_piecewise_cuda_graph=True).validate()
    with pytest.raises(ConfigError, match="--piecewise-cuda-graph-max-tokens must be >= 1"):
        EngineConfig(piecewise_cuda_graph_max_tokens=0).validate()
    with pytest.raises(ConfigError, match="with --enable-torch-compile is not supported"):
        EngineConfig(enable_piecewise_cuda_graph=True, enable_torch_compile=True).validate()
    bad = CliRunner().invoke(cli, ["generate", "--piecewise-cuda-graph-max-tokens", "x", "hi"])
    assert bad.exit_code == 2 and "is not a valid integer" in bad.output


def test_a_cpu_start_says_the_pieces_are_off(tiny_model_factory, caplog):
    from engine import Engine

    with caplog.at_level(logging.INFO, logger="engine"):
        engine = Engine(tiny_model_factory("llama"), device="cpu", max_total_tokens=256,
                        enable_piecewise_cuda_graph=True)
    assert engine.runner.piecewise_graphs is None
    assert engine.sizing.piecewise_cuda_graph_max_tokens == 0
    assert ("piecewise cuda graph: off (needs a CUDA GPU; on a CPU the decode steps run as "
            "CPU graphs)") in caplog.messages
    out = engine.generate([5, 6, 7], {"max_new_tokens": 2, "ignore_eos": True})
    assert len(out["output_ids"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_capture_on_cuda_equals_eager_and_hf(tiny_model_factory, registries):
    """Real torch.cuda.CUDAGraph pieces: runner logits equal eager ones, and the engine's
    greedy tokens equal HF's with the pieces serving prompts."""
    import transformers

    from engine import Engine

    path = tiny_model_factory("qwen3_qk_norm")
    runner = ModelRunner(path, registries=registries, device=DeviceInfo("cuda", "GPU"),
                         dtype="float32")
    pool = runner.init_kv_pool(2048)
    runner.init_piecewise_cuda_graphs(MAX_TOKENS)
    rows = [pool.alloc_req() for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    new = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 13)]
    # cuBLAS may pick other kernels for the padded row counts: float32 to 1e-4
    assert_pieces_match_eager(runner, batch_of(pool, rows, new, [0, 0, 0]), 1e-4)
    assert_pieces_match_eager(runner, batch_of(pool, rows, [[7] * 6, [8], [9]], [5, 9, 13]),
                              1e-4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval().cuda()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    engine = Engine(path, device="cuda", dtype="float32", max_total_tokens=4096,
                    enable_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=256)
    assert engine.piecewise_cuda_graph.startswith("piecewise cuda graph: on, 15 token sizes")
    prompts = [tok(t).input_ids for t in ZEN]
    outs = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]).cuda(), max_new_tokens=8, do_sample=False,
                          pad_token_id=2)
        assert out["output_ids"] == ref[0, len(p):].tolist()
    assert engine.runner.piecewise_graphs.replays > 0
