"""Pre-quantized FP8 checkpoints in the layout vLLM and llm-compressor write: config.json
``quantization_config: {"quant_method": "fp8", ...}``, each linear ``weight`` stored as
float8_e4m3fn with a float32 ``weight_scale`` (per channel [out, 1] or per tensor []), maybe an
``input_scale``, and per-layer ``self_attn.k_scale`` / ``v_scale`` for an FP8 KV cache."""

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine
from engine.registry import EngineError
from engine_quant_fp8.linear import FP8Linear

pytestmark = pytest.mark.usefixtures("single_torch_thread")
FP8_MAX = 448.0


def write_checkpoint(src, dst, *, per_channel=True, fake=False, ignored=(), input_scale=None,
                     kv_scales=(), config_extra=None):
    """Copy ``src`` with its linear weights quantized, written independently of the plugin.
    ``fake``: store the dequantized weights in float32 instead, and no quantization_config."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = {}
    for name, t in load_file(path).items():
        layer = name.removesuffix(".weight")
        if not name.endswith("_proj.weight") or layer in ignored:
            tensors[name] = t
            continue
        w = t.float()
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
        scale = amax / FP8_MAX
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if fake:
            tensors[name] = q.float() * scale
            continue
        tensors[name], tensors[layer + ".weight_scale"] = q, scale.float()
        if input_scale is not None:
            tensors[layer + ".input_scale"] = torch.tensor(input_scale)
    for i, (k, v) in enumerate(kv_scales):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, path)
    if not fake:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = {
            "quant_method": "fp8", "ignored_layers": list(ignored),
            "activation_scheme": "dynamic" if input_scale is None else "static",
            **(config_extra or {})}
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    return str(dst)


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def fp8_layers(runner):
    return {n: m for n, m in runner.model.named_modules() if isinstance(m, FP8Linear)}


def test_per_channel_checkpoint_matches_on_the_fly_quantization(
        llama, tmp_path, make_runner, forced, prompts):
    ckpt = write_checkpoint(llama, tmp_path / "fp8", input_scale=0.02)
    loaded, on_the_fly = make_runner(ckpt, "fp8"), make_runner(llama, "fp8")
    a, b = fp8_layers(loaded), fp8_layers(on_the_fly)
    assert a.keys() == b.keys() and len(a) == 8
    for name in a:  # the same bytes and scales: the same quantization rule
        assert torch.equal(a[name].weight.view(torch.uint8), b[name].weight.view(torch.uint8))
        assert torch.equal(a[name].weight_scale, b[name].weight_scale)
    assert loaded.weight_bytes == on_the_fly.weight_bytes
    torch.testing.assert_close(forced(loaded, prompts), forced(on_the_fly, prompts),
                               rtol=0, atol=1e-5)  # measured: identical


def test_per_tensor_scales_of_packed_projections_are_each_kept(
        llama, tmp_path, make_runner, forced, prompts):
    """q, k and v (gate and up) each come with their own per-tensor scale and run as one
    matmul here; the result must equal the model with the dequantized weights in float32.
    An ignored layer stays unquantized (in the checkpoint and here)."""
    ignored = ("model.layers.1.mlp.down_proj",)
    ckpt = write_checkpoint(llama, tmp_path / "fp8", per_channel=False, ignored=ignored)
    ref = write_checkpoint(llama, tmp_path / "ref", per_channel=False, ignored=ignored,
                           fake=True)
    loaded = make_runner(ckpt, "fp8")
    assert "model.layers.1.mlp.down_proj" not in fp8_layers(loaded) and len(
        fp8_layers(loaded)) == 7
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert len(set(qkv.weight_scale.flatten().tolist())) == 3  # one per projection
    got, want = forced(loaded, prompts), forced(make_runner(ref), prompts)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_engine_detects_an_fp8_checkpoint_and_its_kv_scales(llama, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="engine")
    ckpt = write_checkpoint(llama, tmp_path / "fp8", kv_scales=[(0.5, 0.25), (2.0, 1.5)])
    engine = Engine(ckpt, kv_cache_dtype="fp8_e4m3", max_total_tokens=512)
    assert engine.quantization == "fp8"
    assert ("quantization: fp8 (engine-quant-fp8 0.1.0), detected from the checkpoint's "
            "quantization_config") in caplog.text
    pool = engine.scheduler.kv.pool
    assert pool.k_scale == [0.5, 2.0] and pool.v_scale == [0.25, 1.5]
    assert "KV cache fp8_e4m3: per-layer K/V scales from the checkpoint" in caplog.text
    out = engine.generate("Simple is", {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    assert len(out["output_ids"]) == 4
    # without a scaled KV dtype the scales are loaded and left unused
    plain = Engine(ckpt, max_total_tokens=512).scheduler.kv.pool
    assert plain.k_scale == [1.0, 1.0] and plain.k_buffer[0].dtype == torch.float32


def drop_scale(src, dst):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.0.self_attn.k_proj.weight_scale"]
    save_file(tensors, path)
    return str(dst)


def test_broken_fp8_checkpoints_say_what_is_wrong(llama, tmp_path, make_runner):
    ckpt = write_checkpoint(llama, tmp_path / "fp8")
    with pytest.raises(EngineError, match=r"'model.layers.0.self_attn.k_proj.weight' is "
                                          r"float8_e4m3fn but it has no "
                                          r"'model.layers.0.self_attn.k_proj.weight_scale'"):
        make_runner(drop_scale(ckpt, tmp_path / "no_scale"), "fp8")
    blocks = write_checkpoint(llama, tmp_path / "blocks",
                              config_extra={"weight_block_size": [128, 128]})
    with pytest.raises(EngineError, match="block-wise quantized"):
        make_runner(blocks, "fp8")
    partial = write_checkpoint(llama, tmp_path / "partial",
                               ignored=("model.layers.0.self_attn.q_proj",))
    with pytest.raises(EngineError, match="only part of the packed projections"):
        make_runner(partial, "fp8")
