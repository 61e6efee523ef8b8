"""benchmarks/cuda_graphs.py builds one engine at a time: each is closed and collected before the
next one sizes its KV pool from the free memory. An engine's runner and its CUDA-graph runner
refer to each other, so dropping the engine alone leaves the model and the pool alive."""

from __future__ import annotations

import gc
import os
import sys
import weakref

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import cuda_graphs  # noqa: E402

from engine_testing.graphs import EagerGraph  # noqa: E402


@pytest.fixture
def make_engine(tiny_model_factory):
    """CPU engines whose runner captured decode graphs (the EagerGraph stand-in, through the
    triton backend under the interpreter): the runner <-> CudaGraphRunner cycle of a GPU run."""
    from engine import Engine

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set by the root conftest)")
    path = tiny_model_factory("llama")
    built = []

    def make(mode):
        # every engine built before this one must be gone by now
        assert [ref() for ref in built] == [None] * len(built), "a previous engine is alive"
        engine = Engine(path, device="cpu", attention_backend="triton")
        engine.runner.init_cuda_graphs([1], graph_cls=EagerGraph)
        built.append(weakref.ref(engine.runner))
        return engine

    make.built = built
    return make


def test_the_cycle_keeps_a_dropped_engines_runner(make_engine):
    """Why the benchmark collects: without gc.collect() the runner outlives its engine."""
    gc.collect()
    gc.disable()
    try:
        engine = make_engine(False)
        del engine
        assert make_engine.built[0]() is not None
    finally:
        gc.enable()
    gc.collect()
    assert make_engine.built[0]() is None


def test_each_engine_is_collected_before_the_next_is_built(make_engine):
    gc.disable()  # only the benchmark's own collection may free them
    try:
        results = cuda_graphs.measure_one_at_a_time(
            make_engine, (False, True), lambda engine: engine.runner.cuda_graphs.sizes)
    finally:
        gc.enable()
    assert results == {False: [1], True: [1]}
    assert [ref() for ref in make_engine.built] == [None] * 2
