"""Plugin loading: hook validation, built-ins, entry points, broken plugins, allow/deny lists."""

import json
import os
import subprocess
import sys

import pluggy
import pytest

from engine import hookimpl
from engine.plugins import (PluginInfo, build_registries, load_entry_points, new_plugin_manager,
                            register_builtins)
from engine.registry import DuplicateRegistration

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")


def fresh(*plugins, entry_points=False):
    pm, infos = new_plugin_manager(), {}
    register_builtins(pm, infos)
    if entry_points:
        load_entry_points(pm, infos)
    for i, p in enumerate(plugins):
        pm.register(p, name=f"test-plugin-{i}")
        infos[f"test-plugin-{i}"] = PluginInfo(f"test-plugin-{i}", f"test-dist-{i}", "9.9")
    pm.check_pending()
    return pm, infos


def test_misspelled_hook_fails_check_pending():
    class Bad:
        @hookimpl
        def register_attention_backend(self, register):  # missing "s"
            pass

    pm = new_plugin_manager()
    pm.register(Bad(), name="bad")
    with pytest.raises(pluggy.PluginValidationError, match="register_attention_backend"):
        pm.check_pending()


def test_builtins_register_through_hooks():
    pm, infos = fresh()
    regs = build_registries(pm, infos)
    assert "torch_native" in regs.attention
    assert regs.attention.get("torch_native").dist == "built-in"
    assert {"auto", "bf16", "fp16", "fp32"} <= set(regs.kv_dtypes.names())
    assert "LlamaForCausalLM" in regs.models and "Qwen3ForCausalLM" in regs.models
    assert len(regs.policies) == 0  # the core ships no policy; the plugins do


def test_entry_points_register_bundled_plugins():
    pm, infos = fresh(entry_points=True)
    regs = build_registries(pm, infos)
    assert {"fa3", "flashinfer", "trtllm_mha", "torch_native"} <= set(regs.attention.names())
    assert regs.attention.get("flashinfer").dist == "engine-attention-flashinfer"
    assert {"lpm", "fcfs", "lifo"} <= set(regs.policies.names())
    assert {"fp8_e4m3", "fp8_e5m2"} <= set(regs.kv_dtypes.names())
    assert "fp8" in regs.quantization


def test_duplicate_name_names_both_distributions():
    class Clash:
        @hookimpl
        def register_attention_backends(self, register):
            register("torch_native", lambda ctx: None)

    pm, infos = fresh(Clash())
    with pytest.raises(DuplicateRegistration) as err:
        build_registries(pm, infos)
    assert "built-in" in str(err.value) and "test-dist-0" in str(err.value)


def test_raising_hook_is_reported_and_others_still_load():
    class Broken:
        @hookimpl
        def register_schedule_policies(self, register):
            raise RuntimeError("boom")

    class Good:
        @hookimpl
        def register_schedule_policies(self, register):
            register("good", lambda config: None)

    pm, infos = fresh(Broken(), Good())
    regs = build_registries(pm, infos)
    assert "good" in regs.policies
    assert "RuntimeError: boom" in infos["test-plugin-0"].error


def run_engine(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([ENGINE, *args], capture_output=True, text=True, env=full_env,
                          timeout=120)


def test_broken_entry_point_plugin_is_reported_by_name(tmp_path):
    # a real distribution whose import fails, found through the entry-point machinery
    dist = tmp_path / "engine_broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: engine-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[engine]\nbroken = engine_broken_missing_module\n")
    out = run_engine("plugins", "--json", env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    errors = {e["plugin"]: e["error"] for e in data["errors"]}
    assert "ModuleNotFoundError" in errors["broken"]
    assert "lpm" in [p["name"] for p in data["policies"]]  # the others still loaded


def test_engine_plugins_allow_list_and_disable():
    only_lpm = json.loads(run_engine("plugins", "--json",
                                     env={"ENGINE_PLUGINS": "engine-policy-lpm"}).stdout)
    assert [p["name"] for p in only_lpm["policies"]] == ["lpm"]
    assert [a["name"] for a in only_lpm["attention"]] == ["torch_native"]
    no_example = json.loads(run_engine("plugins", "--json",
                                       env={"ENGINE_DISABLE_PLUGINS": "example_plugin"}).stdout)
    assert "lifo" not in [p["name"] for p in no_example["policies"]]


# -- the example plugin's backend, option and observer, through a real Engine ----------------
def test_a_plugin_backend_gets_its_serve_option_and_observers_see_every_step(tiny_model_factory,
                                                                           tmp_path):
    import engine_example_plugin as example
    from engine import Engine
    from engine_cli.main import cli
    from click.testing import CliRunner

    path = tiny_model_factory("LlamaForCausalLM")
    before = len(example.SEEN_STEPS)
    engine = Engine(path, device="cpu", max_total_tokens=256, attention_backend="example_native",
                    plugin_options={"example_plugin": {"example_tag": "blue"}})
    assert example.BACKENDS[-1].ctx.options == {"example_tag": "blue"}
    engine.generate(["one two", "three"], {"max_new_tokens": 5, "ignore_eos": True})
    steps = [s.step for s in example.SEEN_STEPS[before:]]
    assert steps == list(range(steps[0], steps[0] + len(steps))) and len(steps) >= 5
    assert len(steps) == engine.scheduler.step_no  # this engine's every step, none missed
    # the same through the CLI flag the plugin registered
    (tmp_path / "in.jsonl").write_text('{"prompt": "hello"}\n')
    out = CliRunner().invoke(cli, ["generate", "--model", path, "--device", "cpu",
                                   "--max-total-tokens", "256", "--attention-backend",
                                   "example_native", "--example-tag", "red", "--max-new-tokens",
                                   "2", "--input", str(tmp_path / "in.jsonl"), "--output",
                                   str(tmp_path / "out.jsonl")])
    assert out.exit_code == 0, out.output
    assert example.BACKENDS[-1].ctx.options == {"example_tag": "red"}


def test_a_raising_observer_is_logged_and_the_engine_goes_on(tiny_model_factory, caplog):
    import logging

    from engine import Engine
    from engine.plugins import load_plugins

    class Raiser:
        @hookimpl
        def engine_started(self, engine):
            raise RuntimeError("start boom")

        @hookimpl
        def step_finished(self, stats):
            raise ValueError("step boom")

    pm = load_plugins()
    pm.register(Raiser(), name="raiser")
    try:
        with caplog.at_level(logging.ERROR, logger="engine"):
            engine = Engine(tiny_model_factory("LlamaForCausalLM"), device="cpu",
                            max_total_tokens=256)
            out = engine.generate("hi", {"max_new_tokens": 4, "ignore_eos": True})
    finally:
        pm.unregister(name="raiser")
    assert len(out["output_ids"]) == 4
    errors = [r.getMessage() for r in caplog.records if "raiser" in r.getMessage()]
    assert errors == [
        "plugin raiser: its engine_started hook raised RuntimeError: start boom; ignored "
        "(logged once)",
        "plugin raiser: its step_finished hook raised ValueError: step boom; ignored "
        "(logged once)"]


def test_select_attention_backend_gets_the_model_config(tiny_model_factory):
    """A platform plugin's select_attention_backend sees the checkpoint's ModelConfig (and the
    KV dtype, page size and registries under resolution) and its answer is taken."""
    from engine import Engine
    from engine.plugins import load_plugins

    seen = {}

    class Picker:
        @hookimpl
        def select_attention_backend(self, device, model_config, kv_dtype, page_size,
                                     registries, dtype):
            seen.update(arch=model_config.architecture, layers=model_config.num_layers,
                        kv=kv_dtype, page=page_size, dtype=dtype,
                        has_torch_native="torch_native" in
                        registries.attention)
            return "torch_native"

    pm = load_plugins()
    pm.register(Picker(), name="picker")
    try:
        engine = Engine(tiny_model_factory("LlamaForCausalLM"), device="cpu",
                        max_total_tokens=256)
    finally:
        pm.unregister(name="picker")
    assert engine.attention_backend == "torch_native"  # the cpu plugin would win otherwise
    assert seen == {"arch": "LlamaForCausalLM", "layers": engine.runner.model_config.num_layers,
                    "kv": "auto", "page": None, "dtype": "float32", "has_torch_native": True}
