import json

import torch
from click.testing import CliRunner

from engine.plugins import get_registries
from engine_cli.main import cli


def test_plugin_is_installed():
    data = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).output)
    assert "engine-quant-fp8" in {p["dist"] for p in data["plugins"]}


def test_registration_shape():
    regs = get_registries()
    assert regs.quantization.get("fp8").dist == "engine-quant-fp8"
    e4m3 = regs.kv_dtypes.get("fp8_e4m3").obj
    assert e4m3.storage == torch.float8_e4m3fn and e4m3.needs_scale
    assert regs.kv_dtypes.get("fp8_e5m2").obj.storage == torch.float8_e5m2


def test_detects_fp8_checkpoints():
    method = get_registries().quantization.get("fp8").obj
    assert method.detect({"quantization_config": {"quant_method": "fp8"}})
    assert not method.detect({})
