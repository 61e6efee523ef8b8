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
    ``fake``: store the dequantized weights in float32 instead, and no quantization_config.
    ``input_scale``: a static activation scale for every projection, or a dict projection name
    (q_proj, ...) -> scale."""
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
            proj = layer.rpartition(".")[2]
            scale = input_scale[proj] if isinstance(input_scale, dict) else input_scale
            tensors[layer + ".input_scale"] = torch.tensor(scale)
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
    ckpt = write_checkpoint(llama, tmp_path / "fp8")
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


def edit_tensors(src, dst, edit):
    """Copy checkpoint ``src`` to ``dst`` with ``edit(tensors)`` applied to its tensors."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return str(dst)


def drop_scale(src, dst):
    return edit_tensors(src, dst,
                        lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_scale"))


def test_broken_fp8_checkpoints_say_what_is_wrong(llama, tmp_path, make_runner):
    ckpt = write_checkpoint(llama, tmp_path / "fp8")
    with pytest.raises(EngineError, match=r"'model.layers.0.self_attn.k_proj.weight' is "
                                          r"float8_e4m3fn but it has no "
                                          r"'model.layers.0.self_attn.k_proj.weight_scale'"):
        make_runner(drop_scale(ckpt, tmp_path / "no_scale"), "fp8")
    blocks = write_checkpoint(llama, tmp_path / "blocks",
                              config_extra={"weight_block_size": [128, 128]})
    # per-channel scales under a block-wise config: not the blocks' grid (test_fp8_blockwise.py
    # has the checkpoints that are)
    with pytest.raises(EngineError, match=r"'model.layers.0.self_attn.q_proj.weight_scale' has "
                                          r"shape \(128, 1\); a 128 x 128 weight in blocks of "
                                          r"\[128, 128\] \(weight_block_size\) needs \(1, 1\)"):
        make_runner(blocks, "fp8")
    partial = write_checkpoint(llama, tmp_path / "partial",
                               ignored=("model.layers.0.self_attn.q_proj",))
    with pytest.raises(EngineError, match="only part of the packed projections"):
        make_runner(partial, "fp8")


# static activation scales, per projection; a packed matmul (q/k/v, gate/up) reads one x, so it
# uses the largest of its projections' (vLLM's rule). Powers of two, so that the reference's
# rounding (x ≈ q * scale, in float32) is exact and it computes what the plugin does bit for
# bit: with other scales both are right, but 1e-7 differences flip an activation's rounding
# now and then, and a flip moves logits by up to 0.07 downstream.
INPUT_SCALES = {"q_proj": 2 ** -6, "k_proj": 2 ** -5, "v_proj": 2 ** -6, "o_proj": 2 ** -6,
                "gate_proj": 2 ** -6, "up_proj": 2 ** -7, "down_proj": 2 ** -6}
USED_SCALES = {"qkv_proj": 2 ** -5, "o_proj": 2 ** -6, "gate_up_proj": 2 ** -6,
               "down_proj": 2 ** -6}


def round_activations(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The static scheme, written here independently: x -> e4m3 q with x ≈ q * scale."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def test_static_input_scales_round_the_activations(llama, tmp_path, make_runner, forced,
                                                   prompts, logit_error, caplog):
    """activation_scheme "static": every linear rounds its input to e4m3 with the checkpoint's
    input_scale. The reference is the same weights loaded without scales, each linear's input
    rounded by this file's own code: equal (measured 0 difference). Against float32 the
    activations add their rounding to the weights': about sqrt(2) x the 0.09 of fp8 weights
    alone (test_fp8_model.py) = 0.13 of the logits' spread, measured 0.127, the largest error
    0.72 logit std, top-1 agreement 1.0 where float32's top two are 0.3 apart."""
    caplog.set_level(logging.INFO, logger="engine")
    static = make_runner(write_checkpoint(llama, tmp_path / "static", input_scale=INPUT_SCALES),
                         "fp8")
    assert ("fp8 linear layers: weights stay FP8 and are dequantized per layer in the forward "
            "in 8 of 8 (cpu has no FP8 matmul; activations rounded to FP8 with the "
            "checkpoint's static input_scale)") in caplog.text
    reference = make_runner(write_checkpoint(llama, tmp_path / "dynamic"), "fp8")
    w8a16 = forced(reference, prompts)
    for name, layer in fp8_layers(static).items():
        scale = USED_SCALES[name.rpartition(".")[2]]
        assert layer.input_scale.item() == scale
        ref_layer = reference.model.get_submodule(name)
        ref_layer.forward = (lambda x, f=ref_layer.forward, s=scale:
                             f(round_activations(x, s).to(x.dtype)))
    got, want = forced(static, prompts), forced(reference, prompts)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    assert logit_error(got, w8a16)[0] > 0.03  # the rounding is not a no-op (measured 0.089)
    f32 = forced(make_runner(llama), prompts)
    rel_rms, max_err = logit_error(got, f32)
    assert rel_rms <= 0.18 and max_err <= 1.2, (rel_rms, max_err)
    top2 = f32.topk(2, dim=-1).values
    confident = top2[..., 0] - top2[..., 1] >= 0.3
    assert (got.argmax(-1) == f32.argmax(-1))[confident].float().mean() >= 0.99


def test_static_scales_that_cannot_be_honoured_are_refused(llama, tmp_path, make_runner):
    static = write_checkpoint(llama, tmp_path / "static", input_scale=0.02)
    name = "model.layers.0.self_attn.k_proj.input_scale"
    missing = edit_tensors(static, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(EngineError, match=f"lacks 1 tensor.*{name}"):
        make_runner(missing, "fp8")
    per_token = edit_tensors(static, tmp_path / "per_token",
                             lambda t: t.update({name: torch.full((4, 1), 0.02)}))
    with pytest.raises(EngineError, match=f"'{name}' has shape \\(4, 1\\); .* one static "
                                          f"activation scale per tensor only"):
        make_runner(per_token, "fp8")
    zero = edit_tensors(static, tmp_path / "zero", lambda t: t.update({name: torch.tensor(0.)}))
    with pytest.raises(EngineError, match="must be positive and finite"):
        make_runner(zero, "fp8")
    undeclared = write_checkpoint(llama, tmp_path / "undeclared", input_scale=0.02,
                                  config_extra={"activation_scheme": "dynamic"})
    with pytest.raises(EngineError, match="input_scale' \\(a static activation scale\\) but "
                                          "its quantization_config does not say "
                                          "activation_scheme \"static\""):
        make_runner(undeclared, "fp8")
    unknown = write_checkpoint(llama, tmp_path / "unknown",
                               config_extra={"activation_scheme": "per_token"})
    with pytest.raises(EngineError, match="activation_scheme is 'per_token'"):
        make_runner(unknown, "fp8")
