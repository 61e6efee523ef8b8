import json

import pytest
import torch
from click.testing import CliRunner

from engine.device import DeviceInfo, detect_device
from engine.plugins import get_registries
from engine_cli.main import cli


def test_plugin_is_installed():
    data = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).output)
    assert "engine-attention-fa3" in {p["dist"] for p in data["plugins"]}


def test_registration_and_check_reasons():
    entry = get_registries().attention.get("fa3")
    assert entry.dist == "engine-attention-fa3" and "fp8_e4m3" in entry.extra["kv_dtypes"]
    assert "compute capability 9.0" in entry.unavailable_reason(DeviceInfo("cpu", "CPU"))
    assert "found NVIDIA A100 (compute capability 8.0)" in entry.unavailable_reason(
        DeviceInfo("cuda", "NVIDIA A100", (8, 0)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_fa3_on_gpu_is_refused_until_implemented():
    entry = get_registries().attention.get("fa3")
    assert entry.unavailable_reason(detect_device()) is not None
