"""Mixture-of-experts models on the engine's whole path: greedy tokens equal to HF transformers'
through chunked prefill, radix-cache hits and retraction (the scheduler's slots all free
after), the quantization methods on the experts, and what is refused, with its reason
(pipeline parallelism, CUDA and CPU graphs; tp and ep: tests/test_moe_parallel.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from engine import Engine
from engine.config import EngineConfig
from engine.cuda_graph import capture_decode_graphs
from engine.device import DeviceInfo
from engine.interfaces import GraphUnsupported
from engine.layers import moe as moe_layers
from engine.layers.linear import Linear
from engine.layers.moe import Expert, Router
from engine.registry import EngineError
from engine_testing.checkpoints import MOE_CASES
from engine_testing.engine_paths import (
    PROMPTS,
    check_chunked_prefill_and_radix_hits,
    check_retraction,
    hf_greedy,
    ids,
    run_greedy,
)
from engine_testing.graphs import EagerGraph
from engine_testing.logits import teacher_forced_logits

pytestmark = pytest.mark.usefixtures("single_torch_thread")

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=list(MOE_CASES))
def moe_dir(request, tiny_model_factory):
    arch, overrides = MOE_CASES[request.param]
    return tiny_model_factory(arch, **overrides)


def test_chunked_prefill_and_radix_hits_equal_hf(moe_dir):
    engine = Engine(moe_dir, max_total_tokens=2000, chunked_prefill_size=16)
    assert engine.cpu_graph == "cpu graph: off (MoE layers have no CPU graph nodes yet)"
    check_chunked_prefill_and_radix_hits(engine, moe_dir, NEW_TOKENS)


def test_retraction_gives_hf_tokens(moe_dir, caplog):
    check_retraction(moe_dir, NEW_TOKENS, caplog)


def test_torch_compile_leaves_the_experts_out_and_equals_eager(tiny_model_factory):
    """--enable-torch-compile: the sparse blocks are graph breaks (torch.compiler.disable),
    the rest compiles; the tokens are eager's."""
    arch, overrides = MOE_CASES["mixtral_window"]
    path = tiny_model_factory(arch, **overrides)
    engine = Engine(path, max_total_tokens=2000, enable_torch_compile=True,
                    torch_compile_max_bs=16)
    outs, _ = run_greedy(engine, PROMPTS[2:4], NEW_TOKENS)
    assert outs == list(hf_greedy(path, NEW_TOKENS))[2:4]
    assert engine.runner.compiled.calls["compiled"] >= NEW_TOKENS - 1


# -- the quantization methods quantize the experts ------------------------------------------
# fp8/int8 weights against float32, teacher-forced over 6 prompts x 31 positions (8 prefilled,
# then decode steps): the RMS of the logit error over the RMS of the logits' spread, and the
# largest error in logit standard deviations. Two measurements, because an MoE's error has two
# sources. (1) The weights' rounding: replaying the float model's routing decisions (which
# experts, with which weights) isolates it, and it is the dense models' own: on the dense tiny
# cases (llama, qwen3_qk_norm, mistral_window) fp8 measures 0.090-0.093 / 0.49-0.54 and
# w8a8_int8 0.051-0.052 / 0.26-0.36 (fbgemm's [-64, 64] weights); these MoE cases, replayed,
# fp8 0.081-0.094 / 0.41-0.48, w8a8_int8 0.044-0.056 / 0.24-0.29. The bounds are the dense
# fp8 test's (plugins/quant_fp8/tests/test_fp8_model.py: 0.13 / 0.8) and, for int8, the dense
# measurements plus the same ~50% margin. (2) Routing flips: the rounded hidden states change
# some near-tied top-k choices of these random routers (6-13% of the tokens here, counting
# flips that follow from earlier ones), and a flipped expert changes that token's FFN output
# wholesale; unreplayed, Qwen3-MoE measures fp8 0.097 / 0.54-0.76, int8 0.059-0.063 / 0.35-0.75,
# and Mixtral (every layer sparse, top-2: a flip swaps half the block's output, and its experts
# are 4x wider) fp8 0.26 / 4.0, int8 0.16 / 2.6. That end-to-end error is bounded loosely
# (with a ~1.4x margin) together with the flip rate, since it measures the routers' margins,
# not the quantization.
REPLAYED_LIMITS = {"fp8": (0.13, 0.8), "w8a8_int8": (0.08, 0.5)}
END_TO_END_LIMITS = {"fp8": (0.36, 5.6), "w8a8_int8": (0.22, 3.6)}
MAX_FLIPPED_TOKENS = 0.2  # of the (token, layer) routing decisions, any of the k experts changed
QUANT_LAYERS = {"fp8": "engine_quant_fp8.linear:FP8Linear",
                "w8a8_int8": "engine_quant_int8.linear:Int8Linear"}


def quant_class(method: str):
    import importlib

    module, _, name = QUANT_LAYERS[method].partition(":")
    return getattr(importlib.import_module(module), name)


class RoutingTape:
    """Records every routing decision (``engine.layers.moe.route``'s results) of one run, or
    replays a recorded run's in another run of the same batches."""

    def __init__(self, monkeypatch):
        self.recorded, self.replay = [], None
        real = moe_layers.route

        def route(logits, top_k, renormalize, weight_dtype):
            if self.replay is not None:
                return next(self.replay)
            out = real(logits, top_k, renormalize, weight_dtype)
            self.recorded.append(out)
            return out

        monkeypatch.setattr(moe_layers, "route", route)

    def run(self, runner, prompts, replay: list | None = None):
        self.recorded, self.replay = [], None if replay is None else iter(replay)
        logits = teacher_forced_logits(runner, prompts, 8)
        if replay is not None:
            assert next(self.replay, None) is None  # every decision replayed, in order
        self.replay = None
        return logits, self.recorded


def logit_error(got, ref) -> tuple[float, float]:
    diff, spread = got - ref, ref - ref.mean(-1, keepdim=True)
    return (diff.norm() / spread.norm()).item(), (diff.abs().max() / ref.std()).item()


@pytest.mark.parametrize("method", ["fp8", "w8a8_int8"])
def test_quantization_methods_quantize_every_expert(moe_dir, make_runner, method, monkeypatch):
    prompts = [ids(10 + i, 32) for i in range(6)]
    ref_runner = make_runner(moe_dir)
    runner = make_runner(moe_dir, method)
    c = runner.model_config
    sparse = sum(c.is_moe_layer(i) for i in range(c.num_layers))
    cls = quant_class(method)
    experts = [m for m in runner.model.modules() if isinstance(m, Expert)]
    assert len(experts) == c.num_experts * sparse
    # each expert's packed gate+up and its down are the method's layers; nothing is left float
    # but the routers (which stay float, as SGLang and vLLM keep them), norms and embeddings
    assert all(isinstance(e.gate_up_proj, cls) and isinstance(e.down, cls) for e in experts)
    assert not any(isinstance(m, Linear) for m in runner.model.modules())
    routers = [m for m in runner.model.modules() if isinstance(m, Router)]
    assert len(routers) == sparse and all(r.weight.dtype == torch.float32 for r in routers)
    assert runner.weight_bytes < 0.5 * ref_runner.weight_bytes
    tape = RoutingTape(monkeypatch)
    ref, decisions = tape.run(ref_runner, prompts)
    replayed, _ = tape.run(runner, prompts, replay=decisions)
    rel_rms, max_err = logit_error(replayed, ref)
    limit_rms, limit_max = REPLAYED_LIMITS[method]
    assert 0.02 <= rel_rms <= limit_rms and max_err <= limit_max, (rel_rms, max_err)
    got, own = tape.run(runner, prompts)
    flipped = sum((a[1].sort(-1).values != b[1].sort(-1).values).any(-1).sum().item()
                  for a, b in zip(decisions, own))
    assert flipped <= MAX_FLIPPED_TOKENS * sum(len(a[1]) for a in decisions)
    rel_rms, max_err = logit_error(got, ref)
    limit_rms, limit_max = END_TO_END_LIMITS[method]
    assert rel_rms <= limit_rms and max_err <= limit_max, (rel_rms, max_err)


# -- refused, each with its reason -----------------------------------------------------------
def test_a_model_built_for_ranks_refuses_too(moe_dir, registries):
    """The same reason if a rank builds the model anyway; a pipeline stage builds its own
    layers (--pp-size through the Engine: tests/test_moe_parallel.py)."""
    from engine.models.checkpoint import open_checkpoint
    from engine.models.config import ModelConfig
    from engine.models.loader import load_model
    from engine.parallel.stage import PPStage
    from engine.runner import resolve_model_class

    ckpt = open_checkpoint(moe_dir)
    config = ModelConfig.from_checkpoint(ckpt, registries.models)
    cls = resolve_model_class(registries, config.architecture)
    with pytest.raises(EngineError, match="--ep-size 4 must divide --tp-size 2"):
        cls(config, tp=SimpleNamespace(size=2, rank=0, ep_size=4))
    last = config.num_layers - 1
    stage = load_model(cls, config, ckpt, torch.float32, pp=PPStage(1, 2, last, last + 1))
    assert list(stage.model.layers) == [str(last)]


def test_graphs_say_why_they_are_off(moe_dir, make_runner):
    runner = make_runner(moe_dir)
    gpu = DeviceInfo("cuda", "H100", (9, 0), native_bf16=True)
    line = capture_decode_graphs(runner, EngineConfig(), gpu,
                                 SimpleNamespace(cuda_graph_max_bs=8), "triton")
    assert line == ("cuda graph: off (MoE layers on the per-expert loop read their per-expert "
                    "token counts on the host, which a captured graph cannot (the fused Triton "
                    "kernel, on CUDA with triton, runs inside graphs))")
    with pytest.raises(GraphUnsupported, match="per-expert loop"):
        runner.init_piecewise_cuda_graphs(64, graph_cls=EagerGraph)
    with pytest.raises(GraphUnsupported, match="MoE layers have no CPU graph nodes yet"):
        runner.init_cpu_graph(8)
