"""Name resolution and the wording of its errors."""

import re

import pytest

from engine.device import DeviceInfo
from engine.plugins import PluginInfo, build_registries, load_entry_points, new_plugin_manager, register_builtins
from engine import hookimpl
from engine.registry import (BackendUnavailable, IncompatibleOptions, UnknownAttentionBackend,
                             default_page_size,
                             UnknownName, backend_kv_dtypes, resolve_attention_backend,
                             resolve_policy, resolve_quantization)

CPU = DeviceInfo("cpu", "CPU (test)")
H100 = DeviceInfo("cuda", "NVIDIA H100", (9, 0))


@pytest.fixture(scope="module")
def regs():
    pm, infos = new_plugin_manager(), {}
    register_builtins(pm, infos)
    load_entry_points(pm, infos)
    return build_registries(pm, infos), pm


@pytest.fixture(scope="module")
def core_only():
    pm, infos = new_plugin_manager(), {}
    register_builtins(pm, infos)
    return build_registries(pm, infos)


def test_unknown_backend_did_you_mean_and_lists_registered(regs):
    with pytest.raises(UnknownAttentionBackend) as err:
        resolve_attention_backend(regs[0], "flashinf", CPU)
    msg = str(err.value)
    assert "Unknown attention backend 'flashinf'. Did you mean 'flashinfer'?" in msg
    assert "torch_native (built-in)" in msg and "flashinfer (engine-attention-flashinfer 0.1.0)" in msg


def test_missing_bundled_backend_says_which_package(core_only):
    with pytest.raises(UnknownName) as err:
        resolve_attention_backend(core_only, "fa3", CPU)
    assert "provided by engine-attention-fa3, which is not installed" in str(err.value)
    assert "pip install ./plugins/attention_fa3" in str(err.value)


def test_unavailable_backend_says_why(regs):
    with pytest.raises(BackendUnavailable) as err:
        resolve_attention_backend(regs[0], "flashinfer", CPU)
    msg = str(err.value)
    assert msg.startswith("'flashinfer' (engine-attention-flashinfer 0.1.0) is installed but "
                          "unusable here: needs an NVIDIA GPU with compute capability >= 8.0")
    # triton too where Triton's interpreter is on (TRITON_INTERPRET=1, as the tests set it);
    # example_native is the tests' example plugin's
    assert re.search(r"Usable: cpu, example_native, torch_native(, triton)?\.$", msg), msg


def test_fa3_on_hopper_without_kernels_names_the_extra(regs):
    with pytest.raises(BackendUnavailable, match=r"engine-attention-fa3\[cuda\]"):
        resolve_attention_backend(regs[0], "fa3", H100)


def test_incompatible_kv_dtype():
    class NarrowBackend:
        @hookimpl
        def register_attention_backends(self, register):
            register("narrow", lambda ctx: None, kv_dtypes=("auto", "bf16"))

    pm, infos = new_plugin_manager(), {}
    register_builtins(pm, infos)
    load_entry_points(pm, infos)
    pm.register(NarrowBackend(), name="narrow-plugin")
    with pytest.raises(IncompatibleOptions) as err:
        resolve_attention_backend(build_registries(pm, infos), "narrow", CPU, kv_dtype="fp8_e5m2")
    assert str(err.value) == ("'narrow' does not support --kv-cache-dtype fp8_e5m2 "
                              "(supports: auto, bf16).")


def test_torch_native_takes_every_registered_kv_dtype(regs, core_only):
    # kv_dtypes="any": it reads K/V through the pool, which dequantizes scaled storage
    assert regs[0].attention.get("torch_native").extra["kv_dtypes"] == "any"
    assert backend_kv_dtypes(regs[0], regs[0].attention.get("torch_native")) == \
        regs[0].kv_dtypes.names()
    for kv in regs[0].kv_dtypes.names():
        assert resolve_attention_backend(regs[0], "torch_native", CPU, kv).name == "torch_native"
    with pytest.raises(UnknownName, match="provided by engine-quant-fp8, which is not installed"):
        resolve_attention_backend(core_only, "torch_native", CPU, kv_dtype="fp8_e4m3")


def test_unknown_kv_dtype_is_reported(regs):
    with pytest.raises(UnknownName, match="Unknown KV-cache dtype 'fp8'"):
        resolve_attention_backend(regs[0], "torch_native", CPU, kv_dtype="fp8")


def test_auto_on_cpu_picks_the_cpu_plugin_over_the_core_default(regs):
    # engine-attention-cpu answers select_attention_backend before the core's trylast answer
    assert resolve_attention_backend(regs[0], "auto", CPU, pm=regs[1]).name == "cpu"
    # it does not read fp8 KV, so the core's answer stands there
    entry = resolve_attention_backend(regs[0], "auto", CPU, kv_dtype="fp8_e4m3", pm=regs[1])
    assert entry.name == "torch_native"


def test_auto_on_cpu_with_the_core_alone_picks_torch_native(core_only):
    pm = new_plugin_manager()
    register_builtins(pm, {})
    assert resolve_attention_backend(core_only, "auto", CPU, pm=pm).name == "torch_native"
    # the hook ranks the registries under test: with the core alone even a GPU gets
    # torch_native (the process-wide registries hold triton, which would win there)
    assert "triton" not in core_only.attention
    assert resolve_attention_backend(core_only, "auto", H100, pm=pm).name == "torch_native"


def test_auto_on_hopper_without_kernels_is_not_a_silent_fallback_to_fa3(regs):
    # fa3 and flashinfer are unusable (no sgl-kernel, no flashinfer), so auto takes the next
    # usable one by priority and says so by name: triton where it is installed
    import importlib.util

    entry = resolve_attention_backend(regs[0], "auto", H100, pm=regs[1])
    has_triton = importlib.util.find_spec("triton") is not None
    assert entry.name == ("triton" if has_triton else "torch_native")


def test_auto_on_a_gpu_orders_the_other_backends_by_priority():
    """After the guide's pick for the architecture (none usable here), the registered
    priorities order the candidates; torch_native (priority 0) comes last."""
    class Backends:
        @hookimpl
        def register_attention_backends(self, register):
            register("low", lambda ctx: None, priority=3)
            register("high", lambda ctx: None, priority=9)
            register("broken", lambda ctx: None, priority=50, check=lambda d: "needs magic")
            register("fp16_only", lambda ctx: None, priority=40, kv_dtypes=("fp16",))

    pm, infos = new_plugin_manager(), {}
    register_builtins(pm, infos)
    pm.register(Backends(), name="backends")
    regs = build_registries(pm, infos)
    assert resolve_attention_backend(regs, "auto", H100, pm=pm).name == "high"
    assert resolve_attention_backend(regs, "auto", H100, "fp16", pm=pm).name == "fp16_only"
    # on a CPU the core's answer stays torch_native
    assert resolve_attention_backend(regs, "auto", CPU, pm=pm).name == "torch_native"


def test_auto_picks_the_guides_backend_by_compute_capability(regs, monkeypatch):
    """With the kernel packages present (faked: their checks look them up with find_spec, and
    fa3's also imports sgl-kernel's FA3 module, faked in sys.modules), auto follows the guide:
    fa3 on Hopper, trtllm_mha on Blackwell, flashinfer on Ampere/Ada, and by priority where the
    guide's pick cannot serve the KV dtype or the GPU is older."""
    import importlib.util
    import sys
    import types

    real = importlib.util.find_spec
    present = {"sgl_kernel", "flashinfer", "triton"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in present else real(name, *a))
    monkeypatch.setitem(sys.modules, "sgl_kernel", types.ModuleType("sgl_kernel"))
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_attn",
                        types.ModuleType("sgl_kernel.flash_attn"))
    pick = {name: resolve_attention_backend(regs[0], "auto", DeviceInfo("cuda", name, cc), kv,
                                            pm=regs[1]).name
            for name, cc, kv in [("H100", (9, 0), "auto"), ("B200", (10, 0), "auto"),
                                 ("A100", (8, 0), "auto"), ("L4", (8, 9), "auto"),
                                 ("T4", (7, 5), "auto"), ("H200", (9, 0), "fp8_e5m2"),
                                 ("B300", (10, 3), "fp8_e5m2")]}
    assert pick == {"H100": "fa3", "B200": "trtllm_mha", "A100": "flashinfer", "L4": "flashinfer",
                    "T4": "triton", "H200": "flashinfer", "B300": "flashinfer"}
    present.discard("sgl_kernel")  # Hopper without sgl-kernel: the guide's second choice
    monkeypatch.delitem(sys.modules, "sgl_kernel.flash_attn")
    monkeypatch.delitem(sys.modules, "sgl_kernel")
    assert resolve_attention_backend(regs[0], "auto", H100, pm=regs[1]).name == "flashinfer"
    # trtllm_mha takes pages of 16, 32 or 64 tokens (64 when --page-size is not given): with
    # --page-size 1 auto passes it over, and asking for it by name says what to change
    b200 = DeviceInfo("cuda", "B200", (10, 0))
    trt = resolve_attention_backend(regs[0], "auto", b200, pm=regs[1], page_size=None)
    assert trt.name == "trtllm_mha" and default_page_size(trt) == 64
    assert resolve_attention_backend(regs[0], "auto", b200, pm=regs[1], page_size=32) == trt
    assert resolve_attention_backend(regs[0], "auto", b200, pm=regs[1],
                                     page_size=1).name == "flashinfer"
    with pytest.raises(IncompatibleOptions, match=re.escape(
            "'trtllm_mha' needs --page-size 16 or 32 or 64, got 1; leave --page-size unset to "
            "get 64.")):
        resolve_attention_backend(regs[0], "trtllm_mha", b200, pm=regs[1], page_size=1)
    assert default_page_size(resolve_attention_backend(regs[0], "flashinfer", H100, pm=regs[1])) == 1
    # fa3 / flashinfer / trtllm_mha run float16 and bfloat16 models: a float32 one gets triton
    # from auto, and naming one says which --dtype to pass
    present.add("sgl_kernel")
    monkeypatch.setitem(sys.modules, "sgl_kernel", types.ModuleType("sgl_kernel"))
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_attn",
                        types.ModuleType("sgl_kernel.flash_attn"))
    for name, cc in [("H100", (9, 0)), ("B200", (10, 0)), ("A100", (8, 0))]:
        gpu = DeviceInfo("cuda", name, cc)
        assert resolve_attention_backend(regs[0], "auto", gpu, pm=regs[1],
                                         dtype="float32").name == "triton"
    assert resolve_attention_backend(regs[0], "auto", H100, pm=regs[1],
                                     dtype="bfloat16").name == "fa3"
    with pytest.raises(IncompatibleOptions, match=re.escape(
            "'fa3' runs float16 or bfloat16 models, not float32: pass --dtype bfloat16")):
        resolve_attention_backend(regs[0], "fa3", H100, pm=regs[1], dtype="float32")


def test_policy_resolution(regs, core_only):
    assert resolve_policy(regs[0], "lpm").extra["cache_aware"] is True
    assert resolve_policy(regs[0], "fcfs").extra["cache_aware"] is False
    with pytest.raises(UnknownName, match="Did you mean 'lpm'"):
        resolve_policy(regs[0], "lmp")
    with pytest.raises(UnknownName, match="No schedule policy is installed.*engine-policy-lpm"):
        resolve_policy(core_only, "lpm")


FP8_CHECKPOINT = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}


def test_quantization_by_flag_or_detected_from_the_checkpoint(regs):
    assert resolve_quantization(regs[0], None, CPU, {}) is None
    assert resolve_quantization(regs[0], "fp8", CPU, {}).name == "fp8"  # quantize at load
    assert resolve_quantization(regs[0], None, CPU, FP8_CHECKPOINT).name == "fp8"  # detected
    assert resolve_quantization(regs[0], "fp8", CPU, FP8_CHECKPOINT).name == "fp8"


def test_quantization_the_checkpoint_names_but_nobody_provides(regs, core_only):
    with pytest.raises(UnknownName) as err:
        resolve_quantization(core_only, None, CPU, FP8_CHECKPOINT)
    msg = str(err.value)
    assert msg.startswith("The checkpoint is quantized with 'fp8' (config.json "
                          "quantization_config.quant_method), which no installed plugin provides.")
    assert "pip install ./plugins/quant_fp8" in msg
    awq = {"quantization_config": {"quant_method": "awq"}}
    with pytest.raises(UnknownName, match="Install a plugin that registers quantization "
                                          "method 'awq'"):
        resolve_quantization(regs[0], None, CPU, awq)
    with pytest.raises(IncompatibleOptions, match="--quantization fp8 does not match the "
                                                  "checkpoint, which is quantized with 'awq'"):
        resolve_quantization(regs[0], "fp8", CPU, awq)
