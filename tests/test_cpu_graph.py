"""CPU graphs (engine/cpu_graph): a decode step replayed as C nodes gives the eager forward's
logits (within float rounding) and tokens, for every Llama-family case, weight format (float16
weights, GGUF Q4_0/Q4_1/Q8_0 blocks weight-only and with int8 activations), KV dtype, instruction
set, batch size (the attention's split-KV path and the whole-request path) and scheduler mode;
and it says why when it is off."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.runner import ModelRunner
from engine_testing.invariants import assert_all_free
from engine_testing.weights import hf_on_half_weights

K = pytest.importorskip("engine_cpu_kernels.kernel", reason="needs engine-cpu-kernels")
pytest.importorskip("engine_attention_cpu", reason="needs engine-attention-cpu")

try:
    FEATURES = K.features()
except K.KernelUnavailable as e:  # no compiler, not x86-64
    pytest.skip(f"engine-cpu-kernels cannot build here: {e}", allow_module_level=True)


def cpu_runner(path, registries, cpu_device, dtype="float16", kv="auto", max_rows=16):
    r = ModelRunner(path, registries=registries, device=cpu_device, dtype=dtype,
                    attention_factory=registries.attention.get("cpu").obj,
                    kv_dtype=registries.kv_dtypes.get(kv).obj)
    r.init_kv_pool(4096, max_reqs=32, max_context_len=512)
    r.init_cpu_graph(max_rows)
    return r


def prompts(n: int, length: int = 0) -> list[list[int]]:
    """n prompts of different lengths (``length``: about that many tokens each)."""
    return [[(7 * i + 13 * j + 3) % 400 + 20 for j in range(length + 5 + 3 * i)]
            for i in range(n)]


def lockstep(runner, ps: list[list[int]], steps: int, rel: float = 1e-4) -> list[list[int]]:
    """Prefill ``ps`` eagerly, then per decode step the eager logits and the graph's for the
    same batch (both store the step's K/V at the same slots): equal within ``rel`` of the
    largest logit, the same greedy token wherever the eager top two are further apart than
    that. Returns the tokens (eager's argmax). Frees what it allocated."""
    graph, pool = runner.cpu_graph, runner.kv_pool
    rows = [pool.alloc_req() for _ in ps]
    lens, new, outs = [0] * len(ps), [list(p) for p in ps], [[] for _ in ps]
    for step in range(steps + 1):
        locs = torch.cat([pool.extend_slots(r, n, len(x)) for r, n, x in zip(rows, lens, new)])
        batch = ForwardBatch.build(new, lens, rows, locs, pool.req_to_token)
        runner.cpu_graph = None
        eager = runner.forward(batch).clone()
        runner.cpu_graph = graph
        if step:
            assert batch.mode == ForwardMode.DECODE and graph.can_run(batch)
            before = graph.replays
            got = runner.forward(batch).clone()
            assert graph.replays == before + 1
            scale = max(1.0, eager.abs().max().item())
            assert (got - eager).abs().max().item() <= rel * scale
            top2 = eager.topk(2, -1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * rel * scale
            assert torch.equal(got.argmax(-1)[clear], eager.argmax(-1)[clear])
        ids = eager.argmax(-1).tolist()
        lens = [n + len(x) for n, x in zip(lens, new)]
        for out, t in zip(outs, ids):
            out.append(t)
        new = [[t] for t in ids]
    for r, n in zip(rows, lens):
        pool.free_request(r, n)
    return outs


@pytest.mark.parametrize("case", ["llama", "mistral_window", "qwen2_bias_window",
                                  "qwen3_qk_norm", "llama_tied", "llama3_rope"])
def test_float16_weights_graph_matches_eager(case, tiny_model_factory, registries, cpu_device):
    """--dtype float16 (the plugin's float16 kernel) in every Llama-family case: q/k norms
    (head_dim 48: the attention's scalar path), biases, sliding windows (decode past the
    window), tied heads, llama3 rope; 3 requests (split-KV) and 9 (one item each)."""
    path = tiny_model_factory(case)
    r = cpu_runner(path, registries, cpu_device)
    ps = prompts(3, 20)
    tokens = lockstep(r, ps, 24)
    lockstep(r, prompts(9), 6)
    hf = hf_on_half_weights(path)
    for p, out in zip(ps, tokens):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=25, do_sample=False, pad_token_id=2)
        assert out == ref[0, len(p):].tolist()


def test_small_prompt_and_mixed_steps_run_in_the_graph(tiny_model_factory, registries,
                                                      cpu_device):
    """A step of at most max_rows tokens that is not a decode (prompt chunks, after a cached
    prefix, next to decodes: each token a row with its own length) gives the eager forward's
    logits, every position's too (prompt logprobs)."""
    r = cpu_runner(tiny_model_factory("qwen3_qk_norm"), registries, cpu_device, max_rows=32)
    graph, pool = r.cpu_graph, r.kv_pool
    rows = [pool.alloc_req() for _ in range(3)]
    steps = [  # (new tokens per request, tokens already in the pool per request)
        ([[5, 9, 14, 3, 77], [8, 2, 91], [4] * 9], [0, 0, 0]),  # EXTEND
        ([[12], [33, 34, 35, 36], [7]], [5, 3, 9]),  # MIXED: a chunk next to decodes
    ]
    for new, lens in steps:
        locs = torch.cat([pool.extend_slots(q, n, len(x)) for q, n, x in zip(rows, lens, new)])
        batch = ForwardBatch.build(new, lens, rows, locs, pool.req_to_token)
        assert graph.can_run(batch)
        for every in (False, True):
            r.cpu_graph = None
            eager = r.forward(batch, return_all_logits=every).clone()
            r.cpu_graph = graph
            before = graph.replays
            got = r.forward(batch, return_all_logits=every).clone()
            assert graph.replays == before + 1 and got.shape == eager.shape
            scale = max(1.0, eager.abs().max().item())
            assert (got - eager).abs().max().item() <= 1e-4 * scale
    big = ForwardBatch.build([[3] * 40], [0], [pool.alloc_req()], None, pool.req_to_token)
    assert not graph.can_run(big)  # 40 tokens > 32 rows: eager


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_graph_matches_eager(qtype, tiny_gguf_factory, registries, cpu_device):
    """A GGUF's blocks as they are (weight-only: the Q4_1 block sums run as a prep node)."""
    r = cpu_runner(tiny_gguf_factory("llama", qtype), registries, cpu_device, dtype="auto")
    assert f"{qtype.lower()} GGUF blocks" in r.linear_kernel
    lockstep(r, prompts(2, 40), 12)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_int8_activation_kernels_and_other_isas(isa, tiny_gguf_factory, registries, cpu_device,
                                                monkeypatch):
    """The int8-activation block kernels (their activations quantized by a prep node) and the
    AVX2 path, forced on an AVX-512 CPU."""
    if isa == "avx512" and not FEATURES & K.FEAT_AVX512_VNNI:
        pytest.skip("this CPU has no AVX512_VNNI")
    if not FEATURES & K.FEAT_AVX2:
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv(K.ISA_ENV, isa)
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", f"{isa}_q8_0")
    r = cpu_runner(tiny_gguf_factory("llama", "Q8_0"), registries, cpu_device, dtype="auto")
    assert f"{isa}_q8_0 kernel" in r.linear_kernel
    lockstep(r, prompts(3, 10), 8)


@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp32"])
def test_kv_cache_dtypes(kv, tiny_model_factory, registries, cpu_device):
    """The node stores K/V as the pool's KVDtype does (rounded to nearest even)."""
    r = cpu_runner(tiny_model_factory("llama"), registries, cpu_device, kv=kv)
    lockstep(r, prompts(2, 30), 10, rel=2e-3 if kv != "fp32" else 1e-4)


def engine(path, **kw):
    from engine import Engine

    return Engine(path, **{"max_total_tokens": 4096, **kw})


def test_start_line_says_on_or_why_off(tiny_gguf_factory, tiny_model_factory, caplog,
                                       monkeypatch):
    caplog.set_level(logging.INFO, logger="engine")
    gguf = tiny_gguf_factory("llama", "Q8_0")
    on = engine(gguf)
    assert on.cpu_graph.startswith("cpu graph: on, steps of up to 64 tokens (")
    assert on.cpu_graph in caplog.text
    assert engine(gguf, disable_cpu_graph=True).cpu_graph == \
        "cpu graph: off (--disable-cpu-graph)"
    assert "cpu graph: off (attention backend TorchNativeBackend has no CPU graph nodes" in \
        engine(gguf, attention_backend="torch_native").cpu_graph
    # a float32 model: on through engine-cpu-kernels' float32 kernel, off with oneDNN's
    assert engine(tiny_model_factory("llama")).cpu_graph.startswith("cpu graph: on, ")
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "torch")
    f32 = engine(tiny_model_factory("llama")).cpu_graph
    monkeypatch.delenv("ENGINE_LINEAR_KERNEL")
    assert f32.startswith("cpu graph: off (layer 0's qkv_proj runs oneDNN on float32 "
                          "weights, which has no CPU graph node")
    assert engine(gguf, cpu_graph_max_bs=3).runner.cpu_graph.max_rows == 3


MIXED = [  # every request kind the scheduler has: greedy, seeded sampling, n > 1, stop ids,
    # penalties, prompt logprobs (echo), top logprobs
    ({"temperature": 0, "max_new_tokens": 12}, {}),
    ({"temperature": 0.8, "seed": 5, "max_new_tokens": 10}, {}),
    ({"temperature": 1.0, "seed": 7, "n": 2, "max_new_tokens": 8}, {}),
    ({"temperature": 0, "max_new_tokens": 16, "stop_token_ids": [77]}, {}),
    ({"temperature": 0.7, "seed": 3, "max_new_tokens": 9, "frequency_penalty": 0.5,
      "repetition_penalty": 1.2}, {}),
    ({"temperature": 0, "max_new_tokens": 6, "logprobs": True,
      "top_logprobs": 3}, {"prompt_logprobs": 2}),
]


def run_mixed(eng) -> list:
    reqs = []
    for i, (params, extra) in enumerate(MIXED * 2):
        reqs += eng.add_request(prompts(12, 8)[i], dict(params, ignore_eos=True), **extra)
    while any(r.finish_reason is None for r in reqs):
        eng.step()
    assert_all_free(eng)
    return [(r.output_ids, [round(x, 3) for x in (r.output_logprobs or [])]) for r in reqs]


@pytest.mark.parametrize("mode", [{}, {"enable_overlap_schedule": True},
                                  {"chunked_prefill_size": 16},
                                  {"cpu_graph_max_bs": 4}])
def test_every_request_kind_and_scheduler_mode(mode, tiny_gguf_factory):
    """The scheduler's request kinds side by side, with the graph and without, in each mode
    (overlap, chunked prefill, batches past --cpu-graph-max-bs run eagerly): the same
    outputs, the slots all free after."""
    gguf = tiny_gguf_factory("llama", "Q8_0")
    with_graph = engine(gguf, **mode)
    assert with_graph.runner.cpu_graph is not None
    got = run_mixed(with_graph)
    assert with_graph.runner.cpu_graph.replays > 0
    assert got == run_mixed(engine(gguf, disable_cpu_graph=True, **mode))
