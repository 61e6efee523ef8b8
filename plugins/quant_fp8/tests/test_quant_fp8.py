"""Registration, the quantize/dequantize helpers and FP8Linear on its own."""

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from engine.device import DeviceInfo
from engine.interfaces import KVDtype
from engine.memory.kv_pool import KVPool
from engine.plugins import get_registries, load_plugins
from engine.registry import resolve_attention_backend, resolve_quantization
from engine_testing.weights import load_float_weight
from engine_cli.main import cli
from engine_quant_fp8.kv import FP8KVDtype
from engine_quant_fp8.linear import FP8Linear
from engine_quant_fp8.quant import E4M3, E5M2, dequantize, quantize_rows, widen_e4m3

CPU = DeviceInfo("cpu", "CPU (test)")


def test_plugin_is_installed():
    data = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).output)
    assert "engine-quant-fp8" in {p["dist"] for p in data["plugins"]}
    fp8 = next(q for q in data["quantization"] if q["name"] == "fp8")
    assert fp8["available"]
    torch_native = next(a for a in data["attention"] if a["name"] == "torch_native")
    assert {"fp8_e4m3", "fp8_e5m2"} <= set(torch_native["kv_dtypes"])


def test_registration_shape():
    regs = get_registries()
    assert regs.quantization.get("fp8").dist == "engine-quant-fp8"
    e4m3 = regs.kv_dtypes.get("fp8_e4m3").obj
    assert e4m3.storage == torch.float8_e4m3fn and e4m3.needs_scale
    assert regs.kv_dtypes.get("fp8_e5m2").obj.storage == torch.float8_e5m2
    # the formats are the plugin's own KVDtype subclass: the pool stores and loads through it
    assert all(isinstance(regs.kv_dtypes.get(n).obj, FP8KVDtype) for n in ("fp8_e4m3",
                                                                           "fp8_e5m2"))


def test_usable_on_cpu_and_on_gpus_without_fp8_tensor_cores():
    regs = get_registries()
    ampere = DeviceInfo("cuda", "NVIDIA A100", (8, 0))
    for device in (CPU, ampere):  # the dequantize path runs there
        assert resolve_quantization(regs, "fp8", device).name == "fp8"


def test_torch_native_reads_fp8_kv_and_auto_picks_it_on_cpu():
    regs = get_registries()
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        assert resolve_attention_backend(regs, "torch_native", CPU, kv).name == "torch_native"
        picked = resolve_attention_backend(regs, "auto", CPU, kv, pm=load_plugins())
        assert picked.name == "torch_native"


def test_detects_fp8_checkpoints():
    method = get_registries().quantization.get("fp8").obj
    assert method.detect({"quantization_config": {"quant_method": "fp8"}})
    assert method.detect({"quantization_config": {"quant_method": "FP8"}})
    assert not method.detect({"quantization_config": {"quant_method": "awq"}})
    assert not method.detect({})


def weights_with_outliers(rows=64, cols=96):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 2, rows)[:, None]
    w[3, 5] = 300.0  # an outlier: its row's other weights fall to tiny fp8 values
    w[7] = 0.0  # an all-zero row must give zeros, not NaN
    return w


@pytest.mark.parametrize("dtype,mantissa", [(E4M3, 3), (E5M2, 2)])
def test_round_trip_error_is_half_an_ulp(dtype, mantissa):
    """Per-channel bound: |w - dq(q(w))| <= 2**-(m+1) |w| in the normal range (m mantissa bits:
    2**-4 for e4m3, 2**-3 for e5m2), and half a subnormal step times the row's scale below it;
    so never above 2**-(m+1) of the channel's max |w|."""
    w = weights_with_outliers()
    q, scale = quantize_rows(w, dtype)
    assert q.dtype == dtype and scale.shape == (w.shape[0], 1)
    err = (dequantize(q, scale) - w).abs()
    fi = torch.finfo(dtype)
    half_ulp = 2.0 ** -(mantissa + 1)
    bound = torch.maximum(w.abs() * half_ulp, fi.smallest_normal * half_ulp * scale)
    assert (err <= bound * (1 + 1e-5) + 1e-30).all()
    row_max = w.abs().amax(1, keepdim=True)
    assert (err <= half_ulp * row_max + 1e-30).all()
    assert torch.isfinite(dequantize(q, scale)).all() and (dequantize(q, scale)[7] == 0).all()


def test_widen_is_exact_for_every_finite_e4m3_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 0x7F / 0xFF are NaN in e4m3fn
    q = codes.view(E4M3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(widen_e4m3(q, dtype).float() * 256, q.float())


def finite_codes(dtype: torch.dtype) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    return codes[torch.isfinite(codes.float())]


@pytest.mark.parametrize("storage", [E4M3, E5M2])
def test_fp8_kv_formats_store_and_load_like_the_interfaces_scaled_rule(storage):
    """The plugin's e4m3 load widens bytes on CPU instead of torch's cast (2x faster there):
    equal to the interface's default for every finite code, scale and activation dtype. Store
    is the default: value / scale, clamped to the format's range (no inf, no NaN)."""
    ours, rule = FP8KVDtype(storage), KVDtype(storage, needs_scale=True)
    q = finite_codes(storage)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for scale in (1.0, 0.37, 3.0, 2.0 ** -7):
            assert torch.equal(ours.load(q, scale, dtype), rule.load(q, scale, dtype))
    x = torch.tensor([1e6, -1e6, 3.0, 0.0])
    stored = ours.store(x, 0.5, storage)
    assert stored.dtype == storage and torch.equal(stored, rule.store(x, 0.5, storage))
    fmax = torch.finfo(storage).max
    assert ours.load(stored, 0.5, torch.float32).tolist() == [fmax / 2, -fmax / 2, 3.0, 0.0]


def test_a_pool_of_a_registered_fp8_format_reads_through_it():
    kv = get_registries().kv_dtypes.get("fp8_e4m3").obj
    pool = KVPool(1, 2, 4, 16, torch.float8_e4m3fn, kv_dtype=kv)
    assert pool.kv_dtype is kv and pool.needs_scale and pool.dtype == torch.float8_e4m3fn
    pool.k_scale[0], pool.v_scale[0] = 0.5, 4.0
    loc = torch.tensor([2, 5, 7])
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4) * 100
    pool.set_kv(0, loc, k, v)
    assert torch.equal(pool.k_buffer[0][loc].view(torch.uint8),
                       (k / 0.5).to(E4M3).view(torch.uint8))
    got_k, got_v = pool.get_kv(0, loc, torch.float32)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 of the value (above its subnormals)
    assert ((got_k - k).abs() <= 2 ** -4 * k.abs() + 2 ** -10).all()
    assert ((got_v - v).abs() <= 2 ** -4 * v.abs() + 2 ** -10 * 4).all()


def make_layer(w: torch.Tensor, shards=None, bias=None, input_scale=None) -> FP8Linear:
    layer = FP8Linear(w.shape[1], w.shape[0], None if bias is None else bias.dtype, shards,
                      static_input=input_scale is not None)
    load_float_weight(layer, w, bias)
    if input_scale is not None:
        layer.load_tensor("input_scale", torch.tensor(input_scale), None)
    layer.finish_loading()
    return layer


def test_fp8_linear_equals_a_linear_over_the_dequantized_weight():
    w = weights_with_outliers()
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(w.shape[0], generator=gen)
    x = torch.randn(5, w.shape[1], generator=gen)
    layer = make_layer(w, bias=bias)
    q, scale = quantize_rows(w)
    assert layer.weight.dtype == E4M3 and torch.equal(layer.weight.view(torch.uint8),
                                                      q.view(torch.uint8))
    ref = F.linear(x, dequantize(q, scale), bias)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    # bfloat16 activations: the same up to four bf16 roundings (matmul output, scale cast,
    # scale product, bias add) of 2**-9 each: 2**-7 of the row's largest output
    xb = x.bfloat16()
    ref_b = F.linear(xb.float(), dequantize(q, scale), bias)
    assert ((layer(xb).float() - ref_b).abs() <= 2 ** -7 * ref_b.abs().amax(1, keepdim=True)).all()


def test_packed_layer_loads_each_projection_with_its_own_scale():
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))
    w[16:32] *= 1e4  # with one scale for all rows, q's weights would sink into subnormals
    layer = make_layer(w, shards={"q_proj": 16, "k_proj": 16, "v_proj": 16})
    parts = layer.forward_split(torch.eye(32))  # each projection's dequantized weight, transposed
    for part, rows in zip(parts, w.split(16)):
        torch.testing.assert_close(part.T, rows, rtol=2 ** -4, atol=1e-4 * rows.abs().max())


def skip_without_an_fp8_gpu(device: str) -> None:
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("torch._scaled_mm FP8 needs compute capability >= 8.9")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_scaled_mm_fast_path_matches_the_dequantize_path(device):
    """On CUDA >= 8.9 the real FP8 GEMM. torch also implements _scaled_mm on CPU (slower there
    than widening, so the plugin does not use it), which checks this call's shapes, scale
    layout and dtypes without a GPU."""
    skip_without_an_fp8_gpu(device)
    from engine_quant_fp8.method import FP8Method

    gen = torch.Generator().manual_seed(3)
    layer = FP8Linear(128, 256, torch.bfloat16).to(device)
    layer.load_tensor("weight", torch.randn(256, 128, generator=gen) * 0.05, None)
    layer.load_tensor("bias", torch.randn(256, generator=gen), None)
    FP8Method().process_weights(layer)
    assert layer.fast == (device == "cuda")
    layer.fast = True
    x = torch.randn(37, 128, generator=gen).to(device, torch.bfloat16)
    fast = layer(x).float()
    layer.fast = False
    slow = layer(x).float()
    # the fast path also quantizes activations (e4m3, per token): ~1-2% of the output norm
    rel = (fast - slow).norm() / slow.norm()
    assert rel < 0.05, rel


def round_activations(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(E4M3).float() * scale


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_static_input_scale_rounds_the_activations_on_both_paths(device):
    """A static input_scale: x is rounded to e4m3 with it (clamped to ±448: 9.0 below clips)
    before the matmul, on the dequantize path and on the torch._scaled_mm one (which runs on
    CPU too, as above)."""
    skip_without_an_fp8_gpu(device)
    gen = torch.Generator().manual_seed(4)
    w, bias = torch.randn(256, 128, generator=gen) * 0.05, torch.randn(256, generator=gen)
    x = torch.randn(37, 128, generator=gen)
    x[0, 0] = 9.0  # past 448 * 0.02
    layer = make_layer(w, bias=bias, input_scale=0.02).to(device)
    assert not layer.fast and layer.input_scale.item() == pytest.approx(0.02)
    q, scale = quantize_rows(w)
    ref = F.linear(round_activations(x, 0.02), dequantize(q, scale), bias)
    torch.testing.assert_close(layer(x.to(device)).cpu(), ref, rtol=1e-5, atol=1e-5)
    assert (ref - F.linear(x, dequantize(q, scale), bias)).abs().max() > 0.01
    layer.fast = True  # the same rounded x into the FP8 GEMM; its output is bfloat16
    xb = x.bfloat16()
    fast = layer(xb.to(device)).float().cpu()
    ref_b = F.linear(round_activations(xb, 0.02), dequantize(q, scale), bias)
    assert ((fast - ref_b).abs() <= 2 ** -7 * ref_b.abs().amax(1, keepdim=True)).all()
