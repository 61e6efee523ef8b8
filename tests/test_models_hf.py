"""The Llama family against Hugging Face transformers, in float32: logits and greedy decoding."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.quality import prefill_logits as prefill
from engine.registry import EngineError
from engine.runner import ModelRunner
from engine_testing.checkpoints import TINY_CASES
from engine_testing.generation import greedy_generate
from engine_testing.logits import assert_close_logits, compare_prompt_logits

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# max |ours - HF| <= LOGIT_TOL * max(1, max |HF logit|); measured ~5e-7 relative in float32
LOGIT_TOL = 1e-4
PROMPTS = [
    "Beautiful is better than ugly.",
    "Explicit is better than implicit. Simple is better than complex. "
    "Complex is better than complicated. Flat is better than nested.",
    "Now",
    "Errors should never pass silently, unless explicitly silenced.",
]


def hf_model(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None  # compare full-length continuations
    return model


def encode(path, texts=PROMPTS):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    return [tok(t).input_ids for t in texts]


def make_runner(path, registries, device, **kw):
    runner = ModelRunner(
        path, registries=registries, device=device, dtype=kw.pop("dtype", "float32"),
        compile_max_tokens=kw.pop("compile_max_tokens", None),
    )
    runner.init_kv_pool(4096, **kw)
    return runner


# the linear paths: oneDNN-prepacked weights (the CPU default) and plain F.linear; the decoder
# compiled by torch.compile around the prepacked linears has its own test
LINEAR_PATHS = ["prepacked", "plain"]


def runner_on_path(path, registries, device, linear_path, monkeypatch):
    if linear_path == "plain":
        monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "plain")
    runner = make_runner(path, registries, device)
    packed = [m.packed for m in runner.model.modules() if hasattr(m, "packed")]
    assert all(packed) == (linear_path != "plain") and any(packed) == all(packed)
    return runner


@pytest.mark.parametrize("linear_path", LINEAR_PATHS)
@pytest.mark.parametrize("tiny_model_dir", list(TINY_CASES), indirect=True)
def test_logits_match_hf(tiny_model_dir, registries, cpu_device, linear_path, monkeypatch):
    hf = hf_model(tiny_model_dir)
    prompts = encode(tiny_model_dir)
    assert len({len(p) for p in prompts}) == len(prompts) and max(map(len, prompts)) > 12
    runner = runner_on_path(tiny_model_dir, registries, cpu_device, linear_path, monkeypatch)
    last = prefill(runner, prompts)
    every = prefill(runner, prompts, return_all_logits=True)
    assert last.shape == (len(prompts), runner.model_config.vocab_size)
    assert every.shape == (sum(map(len, prompts)), runner.model_config.vocab_size)
    start = 0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p])).logits[0]
            assert_close_logits(last[i], ref[-1], LOGIT_TOL)
            assert_close_logits(every[start : start + len(p)], ref, LOGIT_TOL)
            start += len(p)


@pytest.mark.parametrize("linear_path", LINEAR_PATHS)
@pytest.mark.parametrize("tiny_model_dir", list(TINY_CASES), indirect=True)
def test_greedy_matches_hf_generate(tiny_model_dir, registries, cpu_device, linear_path,
                                    monkeypatch):
    hf = hf_model(tiny_model_dir)
    prompts = encode(tiny_model_dir)
    runner = runner_on_path(tiny_model_dir, registries, cpu_device, linear_path, monkeypatch)
    ours = greedy_generate(runner, prompts, 32)
    for p, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=2)
        assert out == ref[0, len(p) :].tolist()
    assert runner.kv_pool.free_slots == runner.kv_pool.size


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_compiled_decoder_matches_hf(tiny_model_dir, registries, cpu_device, dtype):
    """--enable-torch-compile: prefill and decode through the compiled decoder (one graph for
    every token count: no recompiles), logits and greedy tokens as HF's; with --dtype float16
    the packed float16 linears run inside the graph, as HF on the rounded weights."""
    hf = (hf_model if dtype == "float32" else hf_with_half_weights)(tiny_model_dir)
    prompts = encode(tiny_model_dir)
    runner = make_runner(tiny_model_dir, registries, cpu_device, dtype=dtype,
                         compile_max_tokens=256)
    assert all(m.packed for m in runner.model.modules() if hasattr(m, "packed"))
    compare_prompt_logits(runner, hf, prompts, LOGIT_TOL)
    ours = greedy_generate(runner, prompts, 16)  # batches of 4, then 3, 2, 1 rows (padded)
    for p, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=2)
        assert out == ref[0, len(p):].tolist()
    assert runner.compiled.calls["eager"] == 0 and runner.compiled.calls["compiled"] > 16


def hf_with_half_weights(path):
    """HF in float32 with every linear weight (the LM head too) rounded to float16: what
    ``--dtype float16`` computes on a CPU. A new Parameter unties a tied head, whose embedding
    the engine also keeps in float32."""
    model = hf_model(path)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight.detach().half().float(),
                                               requires_grad=False)
    return model


@pytest.mark.parametrize("tiny_model_dir", list(TINY_CASES), indirect=True)
def test_half_weights_on_cpu_match_hf_on_the_rounded_weights(tiny_model_dir, registries,
                                                             cpu_device, monkeypatch):
    """--dtype float16 on a CPU: float16 linear weights (fbgemm's fp16 GEMM), float32 arithmetic,
    float32 activations and KV cache. Equal, within float32 rounding, to HF run in float32 on the
    float16-rounded weights; greedy tokens equal too. (The core's own kernel: a plugin's
    float16 kernel, engine-cpu-kernels', has its own test.)"""
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "torch")
    runner = make_runner(tiny_model_dir, registries, cpu_device, dtype="float16")
    assert runner.dtype == torch.float32 and runner.kv_pool.dtype == torch.float32
    assert "float16 linear weights" in runner.dtype_reason
    packed = [m for m in runner.model.modules() if hasattr(m, "packed")]
    assert packed and all(m.packed and m.packed_kind == "fp16" for m in packed)
    assert "float16 weights packed for fbgemm's fp16 GEMM" in runner.linear_kernel
    f32 = make_runner(tiny_model_dir, registries, cpu_device)
    # every packed weight in half its float32 bytes (a tied head's copy beside the embedding too)
    halved = sum(m.opaque_bytes for m in packed)
    assert halved and f32.weight_bytes - runner.weight_bytes == halved
    hf = hf_with_half_weights(tiny_model_dir)
    prompts = encode(tiny_model_dir)
    compare_prompt_logits(runner, hf, prompts, LOGIT_TOL)
    ours = greedy_generate(runner, prompts, 24)
    for p, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=2)
        assert out == ref[0, len(p):].tolist()


def test_half_weights_refused_where_they_cannot_run(monkeypatch):
    from engine.device import DeviceInfo
    from engine.models.dtype import cpu_half_weights, resolve_dtype

    cpu = DeviceInfo("cpu", "CPU", native_bf16=False)
    gpu = DeviceInfo("cuda", "H100", (9, 0), native_bf16=True)
    assert resolve_dtype("half", None, cpu)[0] == torch.float32 and cpu_half_weights("half", cpu)
    assert resolve_dtype("float16", None, gpu)[0] == torch.float16
    assert not cpu_half_weights("float16", gpu) and not cpu_half_weights("auto", cpu)
    # a float16 checkpoint on auto stays float32 on a CPU: float16 weights are opted into
    assert resolve_dtype("auto", "float16", cpu)[0] == torch.float32
    assert not cpu_half_weights("float32", cpu)
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "plain")
    with pytest.raises(EngineError, match="--dtype float16 on a CPU stores the linear weights in "
                                          "float16 .*ENGINE_LINEAR_KERNEL=plain.*Use --dtype "
                                          "float32"):
        resolve_dtype("float16", None, cpu)


def test_bf16_stays_close_to_float32(tiny_model_dir, registries, cpu_device):
    prompts = encode(tiny_model_dir)[:2]  # bf16 matmul is slow on CPUs without native bf16
    f32 = prefill(make_runner(tiny_model_dir, registries, cpu_device), prompts, True)
    bf16_runner = make_runner(tiny_model_dir, registries, cpu_device, dtype="bfloat16")
    assert bf16_runner.dtype == torch.bfloat16 and bf16_runner.kv_pool.dtype == torch.bfloat16
    bf16 = prefill(bf16_runner, prompts, True)
    # measured on these 83 positions: top-1 agreement 0.95, max |diff| 0.067 at logit scale
    # 4.0 (mean |diff| 0.010); the flips are where float32's own top-2 margin is that small
    same = bf16.argmax(-1) == f32.argmax(-1)
    assert same.float().mean().item() >= 0.9
    diff = (bf16 - f32).abs().max().item()
    assert diff < 0.05 * f32.abs().max().item()
    top2 = f32.topk(2, -1).values
    assert same[top2[:, 0] - top2[:, 1] > 2 * diff].all()


def test_sharded_checkpoint_loads_like_a_single_file(
    tiny_model_dir, registries, cpu_device, tmp_path
):
    hf = hf_model(tiny_model_dir)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="300KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    prompts = encode(tiny_model_dir)
    one = prefill(make_runner(tiny_model_dir, registries, cpu_device), prompts)
    sharded = prefill(make_runner(str(tmp_path), registries, cpu_device), prompts)
    assert torch.equal(one, sharded)


def test_runner_reports_sizes(tiny_model_dir, registries, cpu_device):
    runner = make_runner(tiny_model_dir, registries, cpu_device)
    c = runner.model_config
    params = sum(
        t.numel() for t in load_file(os.path.join(tiny_model_dir, "model.safetensors")).values()
    )
    assert runner.weight_bytes == 4 * params
    assert runner.kv_bytes_per_token() == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert runner.kv_bytes_per_token() == runner.kv_pool.bytes_per_token()


def test_tiny_tokenizer_loads_offline_with_a_chat_template(tiny_model_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("Simple is better than complex.").input_ids
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1 and len(tok) == 512
    assert tok.decode(ids, skip_special_tokens=True) == "Simple is better than complex."
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\n"


# -- errors a user can make --------------------------------------------------------------------
def copy_model(src, dst, config_edit=None):
    shutil.copytree(src, dst)
    if config_edit:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        config_edit(config)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    return str(dst)


def test_unsupported_architecture_lists_the_supported_ones(
    tiny_model_dir, registries, cpu_device, tmp_path
):
    path = copy_model(
        tiny_model_dir, tmp_path / "m", lambda c: c.update(architectures=["GPT2LMHeadModel"])
    )
    with pytest.raises(EngineError, match="Unsupported model architecture 'GPT2LMHeadModel'") as e:
        ModelRunner(path, registries=registries, device=cpu_device)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(e.value)


def test_directory_without_config_or_weights(tiny_model_dir, registries, cpu_device, tmp_path):
    with pytest.raises(EngineError, match="has no config.json"):
        ModelRunner(str(tmp_path), registries=registries, device=cpu_device)
    shutil.copy(os.path.join(tiny_model_dir, "config.json"), tmp_path)
    with pytest.raises(EngineError, match=r"no \*.safetensors"):
        ModelRunner(str(tmp_path), registries=registries, device=cpu_device)


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight"),
            "lacks 1 tensor.*model.layers.1.self_attn.k_proj.weight",
        ),
        (
            lambda sd: sd.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}),
            "Unexpected tensor 'model.layers.0.self_attn.extra.weight'",
        ),
        (
            lambda sd: sd.update({"model.norm.weight": torch.zeros(3)}),
            r"'model.norm.weight' has shape \(3,\)",
        ),
    ],
)
def test_checkpoint_not_matching_the_config(
    tiny_model_dir, registries, cpu_device, tmp_path, edit, message
):
    path = copy_model(tiny_model_dir, tmp_path / "m")
    weights = os.path.join(path, "model.safetensors")
    sd = load_file(weights)
    edit(sd)
    save_file(sd, weights)
    with pytest.raises(EngineError, match=message):
        ModelRunner(path, registries=registries, device=cpu_device)
