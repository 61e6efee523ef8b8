"""Block-wise FP8 checkpoints in DeepSeek-V3's layout: config.json ``quantization_config:
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
[bn, bk]}``, every projection's ``weight`` float8_e4m3fn with a float32 ``weight_scale_inv``
[ceil(out / bn), ceil(in / bk)] (the router, norms, embedding and head stay float). Written here
independently of the plugin; the reference is HF transformers on the same weights dequantized
(``q * scale`` per block) in float32."""

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.registry import EngineError
from engine_testing.checkpoints import DEEPSEEK_CASES
from engine_testing.generation import greedy_generate
from engine_testing.logits import compare_prompt_logits
from engine_quant_fp8.block import FP8BlockLinear, FP8Latent

pytestmark = pytest.mark.usefixtures("single_torch_thread")
FP8_MAX = 448.0
PROMPTS = [[1, 17, 94, 301, 5, 77, 12], [3, 250, 251, 9], [44] * 5 + [45, 46]]


def write_blockwise(src, dst, block, *, fake=False, drop=None, config_extra=None):
    """Copy ``src`` with every projection's weight (``*_proj``, ``kv_a_proj_with_mqa``) in e4m3 blocks of ``block`` plus its
    ``weight_scale_inv``; ``fake``: the dequantized weights in float32 and no
    quantization_config (the reference); ``drop``: leave this scale out."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = {}
    bn, bk = block
    for name, t in load_file(path).items():
        if not name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            tensors[name] = t
            continue
        w = t.float()
        rows, cols = w.shape
        gr, gc = -(-rows // bn), -(-cols // bk)
        padded = torch.zeros(gr * bn, gc * bk)
        padded[:rows, :cols] = w
        blocks = padded.view(gr, bn, gc, bk)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if fake:
            tensors[name] = (q.float() * scale[:, None, :, None]).view(
                gr * bn, gc * bk)[:rows, :cols].contiguous()
            continue
        tensors[name] = q.view(gr * bn, gc * bk)[:rows, :cols].contiguous()
        scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
        if scale_name != drop:
            tensors[scale_name] = scale
    save_file(tensors, path)
    if not fake:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                         "activation_scheme": "dynamic",
                                         "weight_block_size": list(block),
                                         **(config_extra or {})}
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    return str(dst)


@pytest.fixture(scope="module")
def deepseek(tiny_model_factory):
    arch, overrides = DEEPSEEK_CASES["v3_noaux_tc"]
    return tiny_model_factory(arch, **overrides)


def hf_model(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model


# [32, 16]: rows in two blocks per 48-row projection (the last one partial), so packed
# projections (q_a with kv_a, gate with up) keep each their own blocks; [128, 128]: one partial
# block per weight, as DeepSeek-V3's own size on these tiny widths
@pytest.mark.parametrize("block", [(32, 16), (128, 128)])
def test_blockwise_checkpoint_equals_hf_on_its_dequantized_weights(
        deepseek, tmp_path, make_runner, block, caplog):
    ckpt = write_blockwise(deepseek, tmp_path / "fp8", block)
    with caplog.at_level(logging.INFO, logger="engine"):
        runner = make_runner(ckpt, "fp8")
    layers = [m for m in runner.model.modules() if isinstance(m, FP8BlockLinear)]
    latents = [m for m in runner.model.modules() if isinstance(m, FP8Latent)]
    assert layers and len(latents) == 3  # every layer's kv_b_proj
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    assert all(m.weight.dtype == torch.float32 for m in latents)  # dequantized at load
    assert f"block-wise scales (weight_block_size {list(block)})" in caplog.text
    hf = hf_model(write_blockwise(deepseek, tmp_path / "reference", block, fake=True))
    compare_prompt_logits(runner, hf, PROMPTS, 1e-4)
    for p, out in zip(PROMPTS, greedy_generate(runner, PROMPTS, 12)):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=2)
        assert out == ref[0, len(p):].tolist()


def test_blockwise_weights_take_fp8_bytes(deepseek, tmp_path, make_runner):
    """Each quantized weight keeps one byte per value plus its rows' block factors."""
    runner = make_runner(write_blockwise(deepseek, tmp_path / "fp8", (32, 16)), "fp8")
    for m in runner.model.modules():
        if isinstance(m, FP8BlockLinear):
            assert m.weight.element_size() == 1
            assert m.row_scales.shape == (m.out_features, -(-m.in_features // 16))


def test_broken_blockwise_checkpoints_say_what_is_wrong(deepseek, tmp_path, make_runner):
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    with pytest.raises(EngineError, match=f"has no '{name}'"):
        make_runner(write_blockwise(deepseek, tmp_path / "no_scale", (32, 16), drop=name), "fp8")
    bad = write_blockwise(deepseek, tmp_path / "bad_block", (32, 16))
    with open(os.path.join(bad, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["weight_block_size"] = [32, 32]  # not the scales' grid
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(EngineError, match=r"in blocks of \[32, 32\] \(weight_block_size\) "
                                          r"needs"):
        make_runner(bad, "fp8")
    with pytest.raises(EngineError, match="weight_block_size is 128"):
        make_runner(write_blockwise(deepseek, tmp_path / "odd", (32, 16),
                                    config_extra={"weight_block_size": 128}), "fp8")
