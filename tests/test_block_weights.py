"""A GGUF's Q4_0 / Q4_1 / Q8_0 linear weights run as their blocks (models/block_weights.py):
packed as the file stores them for a kernel registered for that block format (engine-cpu-kernels
has them), with results equal to the dequantized float32 path within float rounding; q/k rows
unpermuted, q/k/v and gate/up concatenated, a tied head on the embedding's blocks; no kernel:
dequantized, and the log says why."""

from __future__ import annotations

import pytest
import torch

from engine.layers.linear import LINEAR_KERNEL_ENV, PrepackedWeight
from engine.models.block_weights import _module_blocks
from engine.quality import prefill_logits
from engine.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("single_torch_thread")

WIDE = {"hidden_size": 256, "intermediate_size": 512}
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 88], list(range(40, 100))]
# max |blocks - dequantized| <= TOL * max |dequantized|: the same float32 products, summed in
# another order (measured ~1e-6)
TOL = 1e-4


def block_kernels_usable(registries, fmt: str) -> bool:
    from engine.registry import resolve_linear_kernel

    return resolve_linear_kernel(registries, fmt, torch.device("cpu")) is not None


def runner(path, registries, device) -> ModelRunner:
    r = ModelRunner(path, registries=registries, device=device, dtype="float32")
    r.init_kv_pool(1024)
    return r


@pytest.mark.parametrize("case", ["llama", "llama_tied"])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0"])
def test_blocks_run_as_they_are_and_match_the_dequantized_path(
        qtype, case, tiny_gguf_factory, registries, cpu_device, monkeypatch):
    fmt = qtype.lower()
    if not block_kernels_usable(registries, fmt):
        pytest.skip(f"no linear kernel for {fmt} blocks usable on this machine "
                    f"(engine-cpu-kernels needs x86-64 with AVX2 and a C compiler)")
    path = tiny_gguf_factory(case, qtype, **WIDE)
    blocks = runner(path, registries, cpu_device)
    linears = [m for m in blocks.model.modules() if isinstance(m, PrepackedWeight)]
    assert all(m.packed_kind == "plugin" and m.kernel.weight_dtype == fmt for m in linears)
    assert f"{len(linears)} {fmt} GGUF blocks" in blocks.linear_kernel
    if case == "llama_tied":  # the head multiplies by the embedding's blocks
        assert blocks.model.lm_head.tied and blocks.model.lm_head.kernel is not None
    monkeypatch.setenv(LINEAR_KERNEL_ENV, "torch")
    floats = runner(path, registries, cpu_device)
    assert "GGUF blocks" not in floats.linear_kernel
    assert blocks.weight_bytes < 0.5 * floats.weight_bytes
    got = prefill_logits(blocks, PROMPTS, True)
    ref = prefill_logits(floats, PROMPTS, True)
    assert (got - ref).abs().max().item() <= TOL * ref.abs().max().item()


def test_the_blocks_are_cached_and_a_cached_start_does_not_parse_the_gguf(
        tiny_model_factory, registries, cpu_device, tmp_path, monkeypatch):
    from engine_testing.gguf_writer import write_gguf

    if not block_kernels_usable(registries, "q4_1"):
        pytest.skip("no linear kernel for q4_1 blocks usable on this machine")
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_model_factory("llama", **WIDE), str(tmp_path / "m.gguf"), "Q4_1")
    first = runner(path, registries, cpu_device)
    assert (first.checkpoint.cache_dir / "blocks.safetensors").is_file()
    again = runner(path, registries, cpu_device)
    assert again.checkpoint._file is None  # weights and blocks from the cache
    assert "q4_1 GGUF blocks" in again.linear_kernel
    assert torch.equal(prefill_logits(first, PROMPTS, True), prefill_logits(again, PROMPTS, True))


def test_without_a_kernel_for_the_blocks_they_are_dequantized_and_the_log_says_so(
        tiny_gguf_factory, registries, cpu_device, monkeypatch):
    monkeypatch.setenv("ENGINE_CPU_ISA", "scalar")  # engine-cpu-kernels registers none
    if block_kernels_usable(registries, "q4_1"):
        pytest.skip("a q4_1 kernel other than engine-cpu-kernels' is installed")
    r = runner(tiny_gguf_factory("llama", "Q4_1", **WIDE), registries, cpu_device)
    assert "q4_1 GGUF blocks dequantized to float32: no usable linear kernel" in r.linear_kernel
    assert all(m.packed_kind != "plugin" for m in r.model.modules()
               if isinstance(m, PrepackedWeight))


class _Blocks:
    """A checkpoint whose tensors are in the given formats (None: not blocks)."""

    def __init__(self, formats: dict):
        self.formats = formats

    def blocks(self, name):
        fmt = self.formats[name]
        return None if fmt is None else (fmt, torch.full((2, 20), len(name), dtype=torch.uint8))


def test_a_packed_module_runs_as_blocks_only_when_all_its_projections_share_a_format():
    ckpt = _Blocks({"q": "q4_1", "k": "q4_1", "v": "q8_0", "f": None})
    fmt, raw = _module_blocks(ckpt, ["q", "k"])
    assert fmt == "q4_1" and raw.shape == (4, 20)  # rows concatenated in shard order
    assert _module_blocks(ckpt, ["q", "v"]) is None
    assert _module_blocks(ckpt, ["q", "f"]) is None
