"""Pipeline parallelism at the model level: two gloo ranks (spawned processes) are two stages;
each builds its part of a tiny model from the same checkpoint, with a KV pool and an attention
backend on its own layers only, and they prefill + greedy-decode together (stage 0 sends its
hidden states to stage 1, which sends the logits back, so both build the same batches); the
logits and tokens must equal the whole model's (HF transformers, float32). Cases: an uneven
split (Llama, 3 layers), a tied head on the last stage (Qwen2), a GGUF file. Plus in-process
tests of the split, what a stage holds and reads, and the errors. Every wait is bounded."""

from __future__ import annotations

import os
import shutil
import traceback
from datetime import timedelta

import pytest
import torch

from engine.parallel.stage import PPStage, make_stage, split_layers
from engine.registry import EngineError
from engine_testing.logits import assert_close_logits
from engine_testing.ranks import case_inputs, hf_reference, run_spawned_ranks

PP = 2
LOGIT_TOL = 1e-4  # relative to the logit scale, as in test_tensor_parallel.py
PROMPTS = ["Beautiful is better than ugly.", "Now", "Errors should never pass silently."]
NEW_TOKENS = 4
LLAMA3 = ("LlamaForCausalLM", {"num_hidden_layers": 3})  # splits 2 + 1
QWEN2_TIED = ("Qwen2ForCausalLM", {"tie_word_embeddings": True})
# name -> (architecture, config overrides, read from a GGUF file of the checkpoint)
CASES = {"llama_uneven": (*LLAMA3, False), "qwen2_tied": (*QWEN2_TIED, False),
         "gguf": (*LLAMA3, True)}
TIMEOUT_S = 240


class StageRunner:
    """One stage: its part of the model, a KV pool of its layers, torch_native on them."""

    def __init__(self, path: str, stage: PPStage | None, quant_method=None):
        from engine.attention.torch_native import TorchNativeBackend
        from engine.interfaces import BackendContext
        from engine.layers.linear import prepack_linears
        from engine.memory.kv_pool import KVPool
        from engine.models.checkpoint import open_checkpoint
        from engine.models.config import ModelConfig
        from engine.models.loader import load_model, weight_bytes
        from engine.parallel.shard import rank_layer_specs
        from engine.plugins import get_registries
        from engine.runner import resolve_model_class

        registries = get_registries()
        ckpt = open_checkpoint(path)
        self.config = c = ModelConfig.from_checkpoint(ckpt, registries.models)
        self.model = load_model(resolve_model_class(registries, c.architecture), c, ckpt,
                                torch.float32, "cpu", quant_method, pp=stage)
        self.weight_bytes = weight_bytes(self.model)  # before prepacking adds packed copies
        prepack_linears(self.model, torch.device("cpu"), torch.float32)
        specs = rank_layer_specs(c, 1, pp=stage)
        layers = c.num_layers if stage is None else stage.num_layers
        self.kv_pool = KVPool(layers, c.num_kv_heads, c.head_dim, 256, torch.float32, "cpu",
                              page_size=16, max_reqs=8, max_context_len=128)
        self.backend = TorchNativeBackend(BackendContext(self.kv_pool, specs, "cpu",
                                                         torch.float32))

    def run(self, batch, return_all_logits: bool = False, hidden=None) -> torch.Tensor:
        from engine.layers.attention import forward_context

        with torch.inference_mode():
            self.backend.init_forward_metadata(batch)
            with forward_context(self.backend, batch):
                return self.model(batch, return_all_logits, hidden).float()


class PipelineRank:
    """The part of ModelRunner the testing helpers use, for one rank of a 2-stage pipeline:
    stage 0 sends its hidden states [T, H] to stage 1, which sends the logits back (their shapes
    follow from the batch), so that both ranks return the same logits."""

    def __init__(self, stage: StageRunner, rank: int):
        self.stage, self.rank, self.kv_pool = stage, rank, stage.kv_pool

    def forward(self, batch, return_all_logits: bool = False) -> torch.Tensor:
        import torch.distributed as dist

        c = self.stage.config
        rows = batch.num_tokens if return_all_logits else batch.batch_size
        if self.rank == 0:
            dist.send(self.stage.run(batch).clone(), dst=1)
            logits = torch.empty(rows, c.vocab_size)
            dist.recv(logits, src=1)
            return logits
        hidden = torch.empty(batch.num_tokens, c.hidden_size)
        dist.recv(hidden, src=0)
        logits = self.stage.run(batch, return_all_logits, hidden).clone()
        dist.send(logits, dst=0)
        return logits


def rank_main(rank: int, port: int, paths: dict, prompts: dict, results) -> None:
    """One stage: join the gloo group, then for each case load its part, take prefill logits
    and greedy tokens; puts (rank, results or a traceback) on ``results``."""
    try:
        import torch.distributed as dist

        from engine.models.checkpoint import open_checkpoint
        from engine.quality import prefill_logits
        from engine_testing.generation import greedy_generate

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=PP, timeout=timedelta(seconds=60))
        out = {}
        try:
            for case, path in paths.items():
                layers = open_checkpoint(path).hf_config["num_hidden_layers"]
                stage = make_stage(layers, rank, PP)
                runner = PipelineRank(StageRunner(path, stage), rank)
                out[case] = {
                    # numpy: a tensor would travel as shared memory the exiting rank frees
                    "logits": prefill_logits(runner, prompts[case],
                                             return_all_logits=True).numpy(),
                    "tokens": greedy_generate(runner, prompts[case], NEW_TOKENS),
                    "weight_bytes": runner.stage.weight_bytes, "stage": stage,
                    "pool_layers": runner.kv_pool.num_layers,
                }
        finally:
            dist.destroy_process_group()
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))
        raise


@pytest.fixture(scope="module")
def pp_run(tiny_model_factory, tiny_gguf_factory):
    """(HF directories, prompts, rank -> results) of every case; the ranks read the GGUF file
    where the case says so."""
    paths, prompts, read = case_inputs(CASES, PROMPTS, tiny_model_factory, tiny_gguf_factory)
    return paths, prompts, run_spawned_ranks(rank_main, PP, (read, prompts), "pp", TIMEOUT_S)


def load(path: str, stage, registries):
    """The model of ``stage`` (None: the whole model) read from ``path``, float32 on the CPU."""
    from engine.models.checkpoint import open_checkpoint
    from engine.models.config import ModelConfig
    from engine.models.loader import load_model
    from engine.runner import resolve_model_class

    ckpt = open_checkpoint(path)
    config = ModelConfig.from_checkpoint(ckpt, registries.models)
    return load_model(resolve_model_class(registries, config.architecture), config, ckpt,
                      torch.float32, "cpu", pp=stage)


@pytest.mark.usefixtures("single_torch_thread")
@pytest.mark.parametrize("case", list(CASES))
def test_pp2_matches_whole_model(pp_run, case, registries):
    from engine.models.loader import weight_bytes

    paths, prompts, got = pp_run
    hf, ref_logits, ref_tokens = hf_reference(paths[case], prompts[case], NEW_TOKENS)
    layers = hf.config.num_hidden_layers
    assert [got[r][case]["stage"] for r in range(PP)] == [make_stage(layers, r, PP)
                                                          for r in range(PP)]
    for rank in range(PP):
        out = got[rank][case]
        logits = torch.from_numpy(out["logits"])
        assert logits.shape == ref_logits.shape
        assert_close_logits(logits, ref_logits, LOGIT_TOL)
        assert out["tokens"] == ref_tokens
        assert out["pool_layers"] == out["stage"].num_layers  # a pool of its own layers only
    # the stages hold the whole model's weights between them, once (a tied head on a last
    # stage that is not the first is its own copy of the embedding)
    whole = load(paths[case], None, registries)
    head = whole.lm_head.weight
    extra = head.numel() * head.element_size() if hf.config.tie_word_embeddings else 0
    assert got[0][case]["weight_bytes"] + got[1][case]["weight_bytes"] == \
        weight_bytes(whole) + extra


def test_split_layers():
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(3, 2) == [(0, 2), (2, 3)]  # the remainder before the last stage
    assert split_layers(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert [e - s for s, e in split_layers(22, 4)] == [5, 6, 6, 5]  # vLLM's get_pp_indices
    assert split_layers(3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert split_layers(7, 1) == [(0, 7)]
    stage = make_stage(3, 1, 2)
    assert stage == PPStage(rank=1, size=2, start=2, end=3)
    assert (stage.is_first, stage.is_last, stage.num_layers) == (False, True, 1)
    first = make_stage(3, 0, 2)
    assert (first.is_first, first.is_last, first.num_layers) == (True, False, 2)


def test_bad_splits_are_refused():
    with pytest.raises(EngineError, match="pipeline parallelism: 2 layers cannot be split over "
                                          "3 stages; use a --pp-size of at most 2"):
        split_layers(2, 3)
    with pytest.raises(EngineError, match="cannot be split over 0 stages"):
        split_layers(2, 0)
    with pytest.raises(EngineError, match="rank 2 is outside 0..1"):
        make_stage(4, 2, 2)


def test_stage_layer_specs():
    """A stage's specs are its global layers' (sliding window included), with the rank's
    head counts."""
    from engine.models.config import ModelConfig
    from engine.parallel.shard import rank_layer_specs

    config = ModelConfig("MistralForCausalLM", hidden_size=64, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=100,
                         sliding_window=8, sliding_window_layers=(2,))
    first, last = (rank_layer_specs(config, 1, pp=make_stage(3, r, 2)) for r in range(2))
    assert [s.sliding_window for s in first] == [None, None]
    assert [s.sliding_window for s in last] == [8]
    assert [(s.num_heads, s.num_kv_heads) for s in last] == [(4, 2)]
    tp2 = rank_layer_specs(config, 2, pp=make_stage(3, 1, 2))
    assert [(s.num_heads, s.num_kv_heads, s.sliding_window) for s in tp2] == [(2, 1, 8)]
    assert len(rank_layer_specs(config, 1)) == 3


def record_safetensors_reads(monkeypatch) -> list[str]:
    """The names of the tensors read from safetensors files from now on (by a checkpoint:
    an HF directory's, a GGUF's cache)."""
    from engine.models.checkpoint import gguf, hf

    real, read = hf.safe_open, []

    class Recording:
        def __init__(self, *args, **kwargs):
            self.opened = real(*args, **kwargs)

        def __enter__(self):
            self.file = self.opened.__enter__()
            return self

        def __exit__(self, *exc):
            return self.opened.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

    for module in (hf, gguf):
        monkeypatch.setattr(module, "safe_open", Recording)
    return read


def checkpoint_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    full = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            full.update(load_file(os.path.join(path, f)))
    return full


def stage_names(names, stage: PPStage, tied: bool = False) -> set:
    """The checkpoint names a stage loads."""
    from engine.parallel.stage import checkpoint_layer

    def mine(n):
        layer = checkpoint_layer(n)
        if layer is not None:
            return stage.holds_layer(layer)
        if n.startswith("model.embed_tokens."):
            return stage.is_first or (tied and stage.is_last)
        return stage.is_last

    return {n for n in names if mine(n)}


@pytest.mark.parametrize("rank", range(PP))
def test_a_stage_holds_and_reads_only_its_part(tiny_model_factory, registries, monkeypatch,
                                               rank):
    """Llama, 3 layers: stage 0 holds the embedding and layers 0-1, stage 1 layer 2 (as
    'model.layers.2', attention layer 0 of its pool), the norm and the head; each reads exactly
    its own checkpoint tensors, and they hold what the checkpoint holds."""
    path = tiny_model_factory(LLAMA3[0], **LLAMA3[1])
    full = checkpoint_tensors(path)
    read = record_safetensors_reads(monkeypatch)
    stage = make_stage(3, rank, PP)
    model = load(path, stage, registries)
    assert sorted(read) == sorted(stage_names(full, stage))
    layers = {n.split(".")[2] for n, _ in model.named_parameters()
              if n.startswith("model.layers.")}
    assert layers == ({"0", "1"} if rank == 0 else {"2"})
    assert hasattr(model.model, "embed_tokens") == (rank == 0)
    assert hasattr(model.model, "norm") == hasattr(model, "lm_head") == (rank == 1)
    attn = [layer.self_attn for layer in model.model.layers.values()]
    assert [a.attn.layer_id for a in attn] == list(range(stage.num_layers))  # local ids
    first = stage.start
    pre = f"model.layers.{first}."
    layer = model.model.layers[str(first)]
    assert torch.equal(layer.self_attn.o_proj.weight, full[pre + "self_attn.o_proj.weight"])
    assert torch.equal(layer.mlp.down_proj.weight, full[pre + "mlp.down_proj.weight"])
    if rank == 1:
        assert torch.equal(model.lm_head.weight, full["lm_head.weight"])
        assert torch.equal(model.model.norm.weight, full["model.norm.weight"])


def test_a_tied_head_on_the_last_stage_loads_the_embedding(tiny_model_factory, registries,
                                                          monkeypatch):
    path = tiny_model_factory(QWEN2_TIED[0], **QWEN2_TIED[1])
    full = checkpoint_tensors(path)
    read = record_safetensors_reads(monkeypatch)
    last = make_stage(2, 1, PP)
    model = load(path, last, registries)
    assert sorted(read) == sorted(stage_names(full, last, tied=True))
    assert not hasattr(model.model, "embed_tokens")
    assert not model.lm_head.tied
    assert torch.equal(model.lm_head.weight, full["model.embed_tokens.weight"])
    first = load(path, make_stage(2, 0, PP), registries)
    assert not hasattr(first, "lm_head")  # the first stage's embedding stays untied, headless


def test_a_stage_dequantizes_only_its_gguf_tensors(tiny_gguf_factory, registries, monkeypatch,
                                                   tmp_path):
    """From a GGUF (no conversion cached yet), a stage dequantizes only its own tensors and
    caches nothing; once a whole-model load cached the conversion, a stage reads only its own
    tensors from the cache."""
    from engine.models import gguf

    path = tiny_gguf_factory(LLAMA3[0], "F32", **LLAMA3[1])
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    real, dequantized = gguf.GGUFFile.array, []

    def recording(self, info):
        dequantized.append(gguf.hf_name(info.name))
        return real(self, info)

    monkeypatch.setattr(gguf.GGUFFile, "array", recording)
    last = make_stage(3, 1, PP)
    load(path, last, registries)
    names = {gguf.hf_name(t.name) for t in gguf.GGUFFile(path).reader.tensors}
    assert sorted(dequantized) == sorted(stage_names(names, last))
    assert not list(tmp_path.glob("gguf/*/*/weights-*"))  # a stage's part is not cached
    load(path, None, registries)  # converts everything and caches it
    read = record_safetensors_reads(monkeypatch)
    first = make_stage(3, 0, PP)
    load(path, first, registries)
    assert sorted(read) == sorted(stage_names(names, first))


def edited_checkpoint(path: str, tmp_path, drop=(), add=None) -> str:
    """A copy of the checkpoint at ``path`` without the tensors ``drop``, plus ``add``."""
    from safetensors.torch import save_file

    out = shutil.copytree(path, tmp_path / "edited")
    tensors = checkpoint_tensors(path)
    for f in out.glob("*.safetensors"):
        f.unlink()
    for name in drop:
        del tensors[name]
    save_file({**tensors, **(add or {})}, str(out / "model.safetensors"))
    return str(out)


def test_missing_and_unexpected_tensors_are_still_errors(tiny_model_factory, registries,
                                                         tmp_path):
    path = tiny_model_factory(LLAMA3[0], **LLAMA3[1])
    gone = "model.layers.2.mlp.down_proj.weight"
    lacking = edited_checkpoint(path, tmp_path / "lacking", drop=[gone])
    load(lacking, make_stage(3, 0, PP), registries)  # another stage's tensor: not needed here
    with pytest.raises(EngineError, match=f"lacks 1 tensor\\(s\\) the model needs: {gone}"):
        load(lacking, make_stage(3, 1, PP), registries)
    stray = "model.layers.3.mlp.up_proj.weight"  # past the model's 3 layers: no stage's
    extra = edited_checkpoint(path, tmp_path / "extra", add={stray: torch.zeros(256, 128)})
    for rank in range(PP):
        with pytest.raises(EngineError, match=f"Unexpected tensor '{stray}'"):
            load(extra, make_stage(3, rank, PP), registries)


def test_a_model_class_without_pp_is_refused(tiny_model_dir, registries):
    from engine.models.checkpoint import open_checkpoint
    from engine.models.config import ModelConfig
    from engine.models.loader import load_model

    class NoPipeline(torch.nn.Module):
        def __init__(self, config, tp=None):
            super().__init__()

    ckpt = open_checkpoint(tiny_model_dir)
    config = ModelConfig.from_checkpoint(ckpt, registries.models)
    with pytest.raises(EngineError, match="architecture LlamaForCausalLM does not support "
                                          "--pp-size yet; serve it with --pp-size 1"):
        load_model(NoPipeline, config, ckpt, torch.float32, pp=make_stage(2, 0, 2))


def one_prefill(runner, prompts):
    from engine.forward_batch import ForwardBatch

    pool = runner.kv_pool
    rows = [pool.alloc_req() for _ in prompts]
    locs = torch.cat([pool.extend_slots(r, 0, len(p)) for r, p in zip(rows, prompts)])
    return ForwardBatch.build(prompts, [0] * len(prompts), rows, locs, pool.req_to_token)


@pytest.mark.usefixtures("single_torch_thread")
def test_stages_in_one_process_and_their_errors(tiny_model_factory, registries):
    """The stages chained in one process equal the whole model, quantized (w8a8_int8, layers
    whole) as well; a later stage without the previous one's hidden states, or the first with
    them, is a clear error."""
    path = tiny_model_factory(LLAMA3[0], **LLAMA3[1])
    prompts = [[0, 5, 9, 30, 7], [0, 11]]
    methods = [None]
    if "w8a8_int8" in registries.quantization:
        methods.append(registries.quantization.get("w8a8_int8").obj)
    for method in methods:
        whole = StageRunner(path, None, method)
        stages = [StageRunner(path, make_stage(3, r, PP), method) for r in range(PP)]
        batch = one_prefill(whole, prompts)
        for s in stages:  # the same slots in every pool
            assert torch.equal(one_prefill(s, prompts).out_cache_loc, batch.out_cache_loc)
        ref = whole.run(batch, return_all_logits=True)
        hidden = stages[0].run(batch)
        assert hidden.shape == (batch.num_tokens, whole.config.hidden_size)
        assert_close_logits(stages[1].run(batch, True, hidden), ref, 1e-5)
        assert_close_logits(stages[1].run(batch, False, hidden), ref[batch.logits_indices],
                            1e-5)
    with pytest.raises(EngineError, match=r"pipeline stage 1 \(layers 2..2\) needs the previous "
                                          r"stage's hidden states of shape \[7, 128\] for this "
                                          r"batch; got none"):
        stages[1].run(batch)
    with pytest.raises(EngineError, match=r"of shape \[7, 128\] for this batch; got \[2, 128\]"):
        stages[1].run(batch, hidden=hidden[:2])
    with pytest.raises(EngineError, match="the first pipeline stage embeds the batch's tokens"):
        stages[0].run(batch, hidden=hidden)
