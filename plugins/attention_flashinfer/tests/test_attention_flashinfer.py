import json

from click.testing import CliRunner

from engine.device import DeviceInfo
from engine.plugins import get_registries
from engine_cli.main import cli


def test_plugin_is_installed():
    data = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).output)
    assert "engine-attention-flashinfer" in {p["dist"] for p in data["plugins"]}


def test_registration_and_check_reasons():
    regs = get_registries().attention
    fi, trt = regs.get("flashinfer"), regs.get("trtllm_mha")
    assert fi.dist == trt.dist == "engine-attention-flashinfer"
    cpu = DeviceInfo("cpu", "CPU")
    assert "compute capability >= 8.0" in fi.unavailable_reason(cpu)
    assert "Blackwell" in trt.unavailable_reason(cpu)
    turing = DeviceInfo("cuda", "T4", (7, 5))
    assert "found T4 (compute capability 7.5)" in fi.unavailable_reason(turing)
