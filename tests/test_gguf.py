"""GGUF checkpoints: tiny random HF models written as GGUF files at test time (as llama.cpp's
converter writes them: its names, its Q/K permutation, quantized blocks), loaded by the engine
and compared with the HF model they came from (F32: the same weights) and with transformers' own
GGUF loader (every quantization type: the same dequantized weights). Bad files get clear errors
that name the file and the tensor or key."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine import Engine
from engine.models.checkpoint import open_checkpoint
from engine.quality import prefill_logits
from engine.registry import EngineError
from engine.runner import ModelRunner
from engine_testing.generation import greedy_generate
from engine_testing.gguf_writer import write_gguf
from engine_testing.logits import compare_prompt_logits
from engine_testing.weights import dense_state_dict

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# max |ours - reference| <= LOGIT_TOL * max(1, max |reference|); measured 0 for F32 against the
# HF model and for quantized files against transformers' GGUF loader (the same float32 math)
LOGIT_TOL = 1e-4
PROMPTS = ["Beautiful is better than ugly.",
           "Explicit is better than implicit. Simple is better than complex. Complex is better "
           "than complicated.",
           "Now is better than never."]
# the Llama family as GGUF expresses it (no sliding window: llama.cpp's llama/qwen2 have none)
ARCH_CASES = {
    "llama": ("llama", {}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("qwen3_qk_norm", {}),
    "llama_tied": ("llama_tied", {}),
    "llama3_rope": ("llama3_rope", {}),  # rope factors travel as the rope_freqs tensor
}
# hidden sizes that every block size divides (K-quants: 256)
WIDE = {"hidden_size": 256, "intermediate_size": 512}
QTYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
          "Q6_K"]


def hf_reference(path: str, gguf_file: str | None = None):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, gguf_file=gguf_file, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model


def tokens(model_dir: str) -> list[list[int]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return [tok(t).input_ids for t in PROMPTS]


def runner_for(path, registries, device) -> ModelRunner:
    runner = ModelRunner(path, registries=registries, device=device, dtype="float32")
    runner.init_kv_pool(2048)
    return runner


def compare_logits(runner, reference, prompts) -> None:
    compare_prompt_logits(runner, reference, prompts, LOGIT_TOL)


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_f32_gguf_matches_the_hf_model_it_came_from(case, tiny_model_factory, tiny_gguf_factory,
                                                    registries, cpu_device):
    name, overrides = ARCH_CASES[case]
    hf_dir = tiny_model_factory(name, **overrides)
    runner = runner_for(tiny_gguf_factory(name, "F32", **overrides), registries, cpu_device)
    hf, prompts = hf_reference(hf_dir), tokens(hf_dir)
    compare_logits(runner, hf, prompts)
    for p, out in zip(prompts, greedy_generate(runner, prompts, 16)):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=2)
        assert out == ref[0, len(p):].tolist()


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantized_gguf_matches_transformers_gguf_loader(qtype, tiny_model_factory,
                                                         tiny_gguf_factory, registries,
                                                         cpu_device):
    path = tiny_gguf_factory("llama", qtype, **WIDE)
    from engine.models.gguf import GGUFFile

    types = {t.tensor_type.name for t in GGUFFile(path).reader.tensors}
    assert qtype in types  # the weights really are stored in that type
    runner = runner_for(path, registries, cpu_device)
    hf = hf_reference(os.path.dirname(path), os.path.basename(path))
    compare_logits(runner, hf, tokens(tiny_model_factory("llama", **WIDE)))


@pytest.mark.parametrize("name,overrides", [
    ("Qwen2ForCausalLM", {}),
    # transformers' GGUF loader ignores the file's attention.key_length for Qwen3 and takes
    # Qwen3Config's default head_dim, 128: a head of 48 (our qwen3 case) would not load there
    ("Qwen3ForCausalLM", {"head_dim": 128}),
])
def test_quantized_gguf_of_other_architectures(name, overrides, tiny_model_factory,
                                               tiny_gguf_factory, registries, cpu_device):
    path = tiny_gguf_factory(name, "Q8_0", **overrides)
    runner = runner_for(path, registries, cpu_device)
    hf = hf_reference(os.path.dirname(path), os.path.basename(path))
    compare_logits(runner, hf, tokens(tiny_model_factory(name, **overrides)))


def test_q8_0_stays_close_to_the_unquantized_model(tiny_model_dir, tiny_gguf_factory,
                                                   registries, cpu_device):
    prompts = tokens(tiny_model_dir)
    f32 = prefill_logits(runner_for(tiny_model_dir, registries, cpu_device), prompts, True)
    q8 = prefill_logits(runner_for(tiny_gguf_factory("llama", "Q8_0"), registries, cpu_device),
                        prompts, True)
    # Q8_0 keeps ~8 bits per weight: measured max |diff| 0.12 at logit scale 3.7
    assert (q8 - f32).abs().max().item() < 0.1 * f32.abs().max().item()
    assert (q8.argmax(-1) == f32.argmax(-1)).float().mean().item() >= 0.9


def test_engine_serves_a_gguf_with_its_own_tokenizer(tiny_model_dir, tiny_gguf_factory):
    import transformers

    path = tiny_gguf_factory("llama", "F32")
    engine = Engine(path, max_total_tokens=2048, chunked_prefill_size=8)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in PROMPTS:
        assert engine.tokenizer(text).input_ids == hf_tok(text).input_ids
    messages = [{"role": "user", "content": "hi"}]
    assert engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True) == \
        hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    hf = hf_reference(tiny_model_dir)
    prompts = tokens(tiny_model_dir)
    outs = engine.generate(input_ids=prompts, sampling_params={
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=2)
        assert out["output_ids"] == ref[0, len(p):].tolist()
    engine.scheduler.check_invariants()


def test_conversion_is_cached_and_the_cache_reads_back_the_same(tiny_model_factory, registries,
                                                                 cpu_device, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    # the dequantized weights (the blocks' own cache: test_block_weights.py)
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "torch")
    path = write_gguf(tiny_model_factory("llama"), str(tmp_path / "m.gguf"), "Q4_0")
    first = runner_for(path, registries, cpu_device)
    assert "dequantized to float32" in first.checkpoint.notes[0]
    assert "cached in" in first.checkpoint.notes[0]
    again = runner_for(path, registries, cpu_device)
    assert "read from the cache" in again.checkpoint.notes[0]
    assert again.checkpoint._file is None  # the GGUF itself was not even parsed
    for (name, a), (_, b) in zip(dense_state_dict(first.model).items(),
                                 dense_state_dict(again.model).items()):
        assert torch.equal(a, b), name
    cache = again.checkpoint.cache_dir
    assert (cache / "config.json").is_file() and (cache / "weights-float32").is_dir()
    for shard in (cache / "weights-float32").glob("*.safetensors"):
        shard.unlink()  # a damaged cache is converted again, not trusted
    third = runner_for(path, registries, cpu_device)
    assert "dequantized to float32" in third.checkpoint.notes[0]
    assert torch.equal(dense_state_dict(third.model)["lm_head.weight"],
                       dense_state_dict(first.model)["lm_head.weight"])


def test_an_unwritable_cache_still_loads(tiny_model_factory, registries, cpu_device, tmp_path,
                                         monkeypatch, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(blocker / "cache"))
    path = write_gguf(tiny_model_factory("llama"), str(tmp_path / "m.gguf"), "Q8_0")
    with caplog.at_level("WARNING", logger="engine"):
        runner = runner_for(path, registries, cpu_device)
    assert "could not cache" in caplog.text
    assert "(not cached)" in runner.checkpoint.notes[-1]


def test_a_directory_holding_one_gguf(tiny_gguf_factory, tmp_path, registries, cpu_device):
    shutil.copy(tiny_gguf_factory("llama", "Q8_0"), tmp_path / "model.gguf")
    assert open_checkpoint(str(tmp_path)).path == str(tmp_path / "model.gguf")
    shutil.copy(tiny_gguf_factory("llama", "F32"), tmp_path / "other.gguf")
    with pytest.raises(EngineError, match="holds 2 GGUF files.*model.gguf, other.gguf"):
        open_checkpoint(str(tmp_path))


def test_tokenizer_flag_overrides_and_a_missing_tokenizer_is_explained(
        tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir, str(tmp_path / "no-tok.gguf"), "F32", tokenizer=False)
    with pytest.raises(EngineError, match=r"no-tok.gguf' carries no tokenizer.*"
                                          r"tokenizer.ggml.model.*--tokenizer DIR"):
        Engine(path, max_total_tokens=1024)
    engine = Engine(path, tokenizer=tiny_model_dir, max_total_tokens=1024)
    out = engine.generate("Now is", {"temperature": 0, "max_new_tokens": 4})
    assert out["meta_info"]["completion_tokens"] >= 1


# -- damaged and unsupported files --------------------------------------------------------------
def test_not_a_gguf_file(tmp_path, registries, cpu_device):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(EngineError, match=r"weights.gguf' is not a GGUF file"):
        ModelRunner(str(path), registries=registries, device=cpu_device)


def test_truncated_file_names_the_tensor(tiny_gguf_factory, tmp_path, registries, cpu_device):
    data = open(tiny_gguf_factory("llama", "F32"), "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(EngineError, match=r"cut.gguf': tensor '[a-z_.0-9]+' ends at byte \d+ "
                                          r"but the file has \d+: the file is truncated"):
        ModelRunner(str(path), registries=registries, device=cpu_device)
    path.write_bytes(data[:100])  # cut inside the header
    with pytest.raises(EngineError, match=r"cut.gguf' could not be read as a GGUF file.*"
                                          r"truncated or damaged \(100 bytes\)"):
        ModelRunner(str(path), registries=registries, device=cpu_device)


def retype_tensor(path, name: str, type_id: int) -> None:
    """Rewrite the type field of tensor ``name`` in a GGUF's tensor table."""
    import struct

    data = bytearray(open(path, "rb").read())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    open(path, "wb").write(bytes(data))


def test_unknown_and_undequantizable_types_name_the_tensor(tiny_gguf_factory, tmp_path,
                                                           registries, cpu_device):
    path = tmp_path / "odd.gguf"
    shutil.copy(tiny_gguf_factory("llama", "F32"), path)
    retype_tensor(path, "blk.1.ffn_up.weight", 250)
    with pytest.raises(EngineError, match=r"odd.gguf': tensor 'blk.1.ffn_up.weight' has "
                                          r"quantization type 250, which the gguf package"):
        ModelRunner(str(path), registries=registries, device=cpu_device)
    shutil.copy(tiny_gguf_factory("llama", "F32"), path)
    retype_tensor(path, "blk.0.attn_norm.weight", 26)  # I32: same size as F32, not a weight
    with pytest.raises(EngineError, match=r"tensor 'blk.0.attn_norm.weight' has quantization "
                                          r"type I32, which gguf [0-9.]+ cannot dequantize "
                                          r"\(it can: F32, F16.*Q4_K"):
        ModelRunner(str(path), registries=registries, device=cpu_device)


def test_shape_mismatch_names_the_gguf_tensor(tiny_model_dir, tmp_path, registries, cpu_device):
    import json

    edited = tmp_path / "edited"
    shutil.copytree(tiny_model_dir, edited)
    config = json.loads((edited / "config.json").read_text())
    config["intermediate_size"] = 300  # the metadata will disagree with the tensors (256)
    (edited / "config.json").write_text(json.dumps(config))
    path = write_gguf(str(edited), str(tmp_path / "bad.gguf"), "F32")
    with pytest.raises(EngineError, match=r"Tensor 'blk.0.ffn_[a-z]+.weight' of .*bad.gguf "
                                          r"\(loaded as 'model.layers.0.mlp.[a-z_]+.weight'\) "
                                          r"has shape .* expects .*GGUF metadata match"):
        ModelRunner(path, registries=registries, device=cpu_device)


def test_unsupported_architecture_is_named(tiny_model_dir, tmp_path, registries, cpu_device):
    path = write_gguf(tiny_model_dir, str(tmp_path / "g.gguf"), "F32", architecture="gpt2")
    with pytest.raises(EngineError, match=r"Unsupported GGUF architecture 'gpt2'.*g.gguf.*"
                                          r"Supported: llama, qwen2, qwen3"):
        ModelRunner(path, registries=registries, device=cpu_device)


def test_cli_reports_a_bad_gguf_without_a_traceback(tmp_path):
    from click.testing import CliRunner

    from engine_cli.main import cli

    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    result = CliRunner().invoke(cli, ["serve", "--model", str(path)])
    assert result.exit_code == 2, result.output
    assert "broken.gguf' could not be read as a GGUF file" in result.output
    assert "Traceback" not in result.output
