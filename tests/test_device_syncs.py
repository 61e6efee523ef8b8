"""A step waits for the device once: the sampled tokens' ``.tolist()``. On a CPU nothing waits,
so the CPU tests count the torch ops that would make the host wait for a GPU (their result's
size or value is read on the host: ``nonzero``, ``.item()``, ``unique``, ``masked_select``,
``repeat_interleave`` without ``output_size``) over decode steps and prompt-chunk steps: the
metadata the host needs is computed from host lists (numpy), never read back. The GPU test
counts real synchronizations with ``torch.cuda.set_sync_debug_mode``."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import Engine

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# ops whose result the host must wait for on a GPU
SYNCING = {"aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select", "aten::unique",
           "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
           "aten::is_nonzero", "aten::equal"}


class SyncingOps(TorchDispatchMode):
    """Counts the torch ops of SYNCING run under it (and repeat_interleave without output_size)."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in SYNCING or (name == "aten::repeat_interleave"
                               and kwargs.get("output_size") is None):
            self.seen[name] += 1
        return func(*args, **kwargs)


def _backends(registries, device) -> list[str]:
    usable = ["torch_native"]
    entry = registries.attention.get("cpu")
    if entry.unavailable_reason(device) is None:
        usable.append("cpu")
    return usable


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_decode_and_prompt_steps_read_nothing_back_from_the_device(backend, tiny_model_dir,
                                                                   registries, cpu_device):
    if backend not in _backends(registries, cpu_device):
        pytest.skip("the cpu attention backend cannot run here (no C compiler)")
    engine = Engine(tiny_model_dir, max_total_tokens=4096, attention_backend=backend,
                    chunked_prefill_size=16)
    params = [{"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
              {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": 40,
               "ignore_eos": True},
              {"temperature": 0.7, "repetition_penalty": 1.1, "max_new_tokens": 40,
               "ignore_eos": True}]
    for i, p in enumerate(params):
        engine.add_request([5 + i, 6, 7, 8, 9] * (i + 1), p)
    for _ in range(4):
        engine.step()
    with SyncingOps() as decode:
        for _ in range(4):  # decode steps, nobody finishes
            engine.step()
    # a 40-token prompt in 16-token chunks beside the decodes (mixed steps, two groups)
    engine.add_request(list(range(10, 50)), {"temperature": 0, "max_new_tokens": 30})
    with SyncingOps() as mixed:
        for _ in range(3):
            engine.step()
    assert not decode.seen and not mixed.seen, (decode.seen, mixed.seen)
    assert len(engine.scheduler.running) == 4
    engine.scheduler.check_invariants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_a_cuda_decode_step_synchronizes_once(tiny_model_dir, graphs):
    engine = Engine(tiny_model_dir, device="cuda", dtype="float32",
                    attention_backend="torch_native" if not graphs else "triton",
                    disable_cuda_graph=not graphs, cuda_graph_max_bs=4, max_total_tokens=4096)
    for i in range(3):
        engine.add_request([5 + i, 6, 7, 8, 9], {"temperature": 0, "max_new_tokens": 40,
                                                 "ignore_eos": True})
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 4, [str(w.message) for w in syncs]  # one per step: the tokens
