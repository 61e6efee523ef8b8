"""Attention backend 'cpu': the C kernel against torch_native on the same pool and metadata,
greedy decoding against HF transformers, and how it is built, picked and refused."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_native import TorchNativeBackend
from engine.forward_batch import ForwardMode
from engine.interfaces import AttentionLayerSpec, BackendContext
from engine.memory.kv_pool import KVPool
from engine.registry import IncompatibleOptions, resolve_attention_backend
from engine.runner import ModelRunner
from engine_testing.attention import compare_backends_step as step
from engine_testing.attention import scattered_filler
from engine_testing.checkpoints import TINY_CASES
from engine_testing.generation import free_requests, greedy_generate
from engine_attention_cpu import check, kernel, select_attention_backend
from engine_attention_cpu.backend import CPUBackend

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def make_pair(specs, kvh, d, dtype=torch.float32, page_size=1, size=512):
    pool = KVPool(len(specs), kvh, d, size, dtype, page_size=page_size, max_reqs=8,
                  max_context_len=256)
    ctx = BackendContext(pool, specs, "cpu", torch.float32)
    return pool, CPUBackend(ctx), TorchNativeBackend(ctx)


# (heads, kv heads, head dim): GQA, MHA, MQA, a wide head
SHAPES = [(4, 2, 8), (4, 4, 16), (8, 1, 64), (2, 1, 128)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_matches_torch_native_in_every_mode(shape, page_size):
    H, KVH, D = shape
    specs = [AttentionLayerSpec(H, KVH, D, D ** -0.5), AttentionLayerSpec(H, KVH, D, 0.3, 5)]
    pool, cpu, native = make_pair(specs, KVH, D, page_size=page_size)
    gen = torch.Generator().manual_seed(0)
    filler, pages = scattered_filler(pool, page_size, 48)  # the requests' slots interleave
    rows = [pool.alloc_req() for _ in range(5)]
    new = [9, 1, 70, 4, 33]  # one prompt longer than a 64-key block, one of a single token
    batch = step(pool, (cpu, native), rows, [0] * 5, new, specs, gen, 1e-5)
    assert batch.mode == ForwardMode.EXTEND and cpu.decode is not None  # the 1-token prompt
    # prompt rows: the C prompt kernel where the head dim is a multiple of 16, else SDPA
    assert (cpu.prompts is not None) == (D % 16 == 0) == (not cpu.groups)
    lens = new
    for _ in range(3):  # decodes across block boundaries and past the window
        batch = step(pool, (cpu, native), rows, lens, [1] * 5, specs, gen, 1e-5)
        lens = [n + 1 for n in lens]
    assert batch.mode == ForwardMode.DECODE and not cpu.groups
    batch = step(pool, (cpu, native), rows, lens, [1, 6, 1, 1, 12], specs, gen, 1e-5)
    assert batch.mode == ForwardMode.MIXED and len(cpu.decode[0]) == 3
    assert (cpu.prompts is not None) == (D % 16 == 0)  # after a cached prefix
    lens = [n + e for n, e in zip(lens, [1, 6, 1, 1, 12])]
    free_requests(pool, rows, lens)
    pool.free_pages(pages[1::2])
    pool.free_req(filler)
    assert pool.free_slots == pool.size


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pools_are_read_as_float32(dtype):
    specs = [AttentionLayerSpec(4, 2, 32, 32 ** -0.5)]
    pool, cpu, native = make_pair(specs, 2, 32, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    rows = [pool.alloc_req() for _ in range(3)]
    # both read the same rounded K/V and compute in float32, so they agree closely
    step(pool, (cpu, native), rows, [0, 0, 0], [20, 3, 90], specs, gen, 1e-5)
    step(pool, (cpu, native), rows, [20, 3, 90], [1, 1, 1], specs, gen, 1e-5)
    free_requests(pool, rows, [21, 4, 91])


def test_scaled_pool_values_are_multiplied_back():
    specs = [AttentionLayerSpec(4, 2, 16, 0.25)]
    pool, cpu, native = make_pair(specs, 2, 16)
    pool.k_scale[0], pool.v_scale[0] = 0.5, 2.0  # as an fp8 dtype sets them; stored values / scale
    pool.needs_scale = True
    gen = torch.Generator().manual_seed(2)
    rows = [pool.alloc_req() for _ in range(2)]
    step(pool, (cpu, native), rows, [0, 0], [7, 30], specs, gen, 1e-5)
    step(pool, (cpu, native), rows, [7, 30], [1, 1], specs, gen, 1e-5)
    free_requests(pool, rows, [8, 31])


@pytest.mark.parametrize("tiny_model_dir", list(TINY_CASES), indirect=True)
def test_greedy_matches_hf_generate(tiny_model_dir, registries, cpu_device):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok(t).input_ids for t in ("Now is better than never.", "Flat is better",
                                          "Although never is often better than right now.")]
    runner = ModelRunner(tiny_model_dir, registries=registries, device=cpu_device,
                         dtype="float32", attention_factory=registries.attention.get("cpu").obj)
    runner.init_kv_pool(2048)
    assert isinstance(runner.backend, CPUBackend)
    ours = greedy_generate(runner, prompts, 32)
    for p, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                          pad_token_id=2, eos_token_id=None)
        assert out == ref[0, len(p):].tolist()
    assert runner.kv_pool.free_slots == runner.kv_pool.size


def test_auto_picks_cpu_on_a_cpu(registries, cpu_device):
    from engine.plugins import pm

    assert resolve_attention_backend(registries, "auto", cpu_device, pm=pm).name == "cpu"
    # fp8 KV is not read by the kernel: auto leaves it to torch_native, and asking says why
    assert select_attention_backend(cpu_device, None, "fp8_e4m3") is None
    with pytest.raises(IncompatibleOptions, match="'cpu' does not support --kv-cache-dtype "
                       "fp8_e4m3 \\(supports: auto, fp32, bf16, fp16\\)"):
        resolve_attention_backend(registries, "cpu", cpu_device, kv_dtype="fp8_e4m3")


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    kernel.load.cache_clear()
    yield tmp_path
    kernel.load.cache_clear()


def test_kernel_is_built_once_into_the_cache(fresh_build, cpu_device):
    assert check(cpu_device) is None
    built = list((fresh_build / "kernels").glob("decode_attention-*.so"))
    assert len(built) == 1
    kernel.load.cache_clear()
    mtime = built[0].stat().st_mtime_ns
    assert check(cpu_device) is None and built[0].stat().st_mtime_ns == mtime


def test_without_a_compiler_it_says_what_it_needs(fresh_build, monkeypatch, cpu_device):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(fresh_build))  # no cc, no gcc
    assert check(cpu_device) == ("needs a C compiler to build its kernel "
                                 "(gcc or cc on PATH, or $CC)")
    assert select_attention_backend(cpu_device, None, "auto") is None


def test_a_failed_build_says_so(fresh_build, monkeypatch, cpu_device, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(kernel, "SOURCE", broken)
    reason = check(cpu_device)
    assert reason.startswith("its kernel failed to build with ") and "broken.c" in reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_key_returns_its_value_exactly(dtype):
    # with a single key the softmax is 1, so the output is V converted to float32: this checks
    # the kernel's own bf16/fp16 decoding on zeros, subnormals, extremes and negatives
    finfo = torch.finfo(dtype)
    values = torch.tensor([0.0, -0.0, finfo.tiny / 4, -finfo.tiny / 2, finfo.tiny, finfo.max,
                           -1.5, 3.140625]).to(dtype)
    k_pool = torch.zeros(2, 1, 8, dtype=dtype)
    v_pool = torch.zeros(2, 1, 8, dtype=dtype)
    v_pool[1, 0] = values
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    q, out = torch.randn(1, 1, 8), torch.empty(1, 1, 8)
    one = torch.tensor([0])
    kernel.decode_attention(q, out, one, k_pool, v_pool, table, one, torch.tensor([1]), None, 1.0)
    assert torch.equal(out[0, 0], values.float())
