"""Name resolution and the wording of its errors."""

import pytest

from engine.device import DeviceInfo
from engine.plugins import PluginInfo, build_registries, load_entry_points, new_plugin_manager, register_builtins
from engine.registry import (BackendUnavailable, IncompatibleOptions, UnknownAttentionBackend,
                             UnknownName, resolve_attention_backend, resolve_policy,
                             resolve_quantization)

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
    assert "Usable: torch_native." in msg


def test_fa3_on_hopper_without_kernels_names_the_extra(regs):
    with pytest.raises(BackendUnavailable, match=r"engine-attention-fa3\[cuda\]"):
        resolve_attention_backend(regs[0], "fa3", H100)


def test_incompatible_kv_dtype(regs):
    with pytest.raises(IncompatibleOptions) as err:
        resolve_attention_backend(regs[0], "torch_native", CPU, kv_dtype="fp8_e5m2")
    assert str(err.value) == ("'torch_native' does not support --kv-cache-dtype fp8_e5m2 "
                              "(supports: auto, bf16, fp16, fp32).")


def test_unknown_kv_dtype_is_reported(regs):
    with pytest.raises(UnknownName, match="Unknown KV-cache dtype 'fp8'"):
        resolve_attention_backend(regs[0], "torch_native", CPU, kv_dtype="fp8")


def test_auto_picks_torch_native_on_cpu(regs):
    entry = resolve_attention_backend(regs[0], "auto", CPU, pm=regs[1])
    assert entry.name == "torch_native"


def test_auto_on_hopper_without_kernels_is_not_a_silent_fallback_to_fa3(regs):
    # fa3 is unusable (no sgl-kernel), so auto takes the next usable one and says so by name
    entry = resolve_attention_backend(regs[0], "auto", H100, pm=regs[1])
    assert entry.name == "torch_native"


def test_policy_resolution(regs, core_only):
    assert resolve_policy(regs[0], "lpm").extra["cache_aware"] is True
    assert resolve_policy(regs[0], "fcfs").extra["cache_aware"] is False
    with pytest.raises(UnknownName, match="Did you mean 'lpm'"):
        resolve_policy(regs[0], "lmp")
    with pytest.raises(UnknownName, match="No schedule policy is installed.*engine-policy-lpm"):
        resolve_policy(core_only, "lpm")


def test_not_implemented_quantization_is_refused(regs):
    with pytest.raises(BackendUnavailable, match="not implemented yet"):
        resolve_quantization(regs[0], "fp8", CPU)
