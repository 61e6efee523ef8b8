"""Tensor parallelism at the model level: two gloo ranks (spawned processes) each build their
shard of a tiny model from the same checkpoint, with their own KV pool on their KV heads, and
prefill + greedy-decode together; the logits and tokens must equal the whole model's (HF
transformers, float32). Cases: KV heads split over the ranks (Llama, 2 KV heads) and
replicated (Qwen2 with qkv bias, 1 KV head < 2 ranks, a tied head and a vocabulary of 511 that
does not split evenly), and the Llama checkpoint read from a GGUF file. Every wait is bounded:
a rank that dies or hangs fails the test."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import pytest
import torch

from engine.registry import EngineError
from engine_testing.logits import assert_close_logits
from engine_testing.ranks import case_inputs, hf_reference, run_spawned_ranks

TP = 2
LOGIT_TOL = 1e-4  # relative to the logit scale, as in test_models_hf.py
PROMPTS = ["Beautiful is better than ugly.", "Now", "Errors should never pass silently."]
NEW_TOKENS = 4
# name -> (architecture, config overrides, read from a GGUF file of the checkpoint)
CASES = {
    "kv_sharded": ("LlamaForCausalLM", {}, False),
    "kv_replicated": ("Qwen2ForCausalLM", {"num_key_value_heads": 1, "vocab_size": 511,
                                           "tie_word_embeddings": True}, False),
    "gguf": ("LlamaForCausalLM", {}, True),
}
TIMEOUT_S = 240


class RankRunner:
    """The part of ModelRunner the testing helpers use, for one rank's sharded model."""

    def __init__(self, path: str, group):
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
        config = ModelConfig.from_checkpoint(ckpt, registries.models)
        model_cls = resolve_model_class(registries, config.architecture)
        self.model = load_model(model_cls, config, ckpt, torch.float32, "cpu", tp=group)
        prepack_linears(self.model, torch.device("cpu"), torch.float32)
        self.weight_bytes = weight_bytes(self.model)
        specs = rank_layer_specs(config, group.size)
        self.kv_heads = specs[0].num_kv_heads
        self.kv_pool = KVPool(config.num_layers, self.kv_heads, config.head_dim, 256,
                              torch.float32, "cpu", page_size=16, max_reqs=8,
                              max_context_len=128)
        self.backend = TorchNativeBackend(BackendContext(self.kv_pool, specs, "cpu",
                                                         torch.float32))

    def forward(self, batch, return_all_logits: bool = False) -> torch.Tensor:
        from engine.layers.attention import forward_context

        with torch.inference_mode():
            self.backend.init_forward_metadata(batch)
            with forward_context(self.backend, batch):
                return self.model(batch, return_all_logits).float()


def rank_main(rank: int, port: int, paths: dict, prompts: dict, results) -> None:
    """One tp rank: join the gloo group, then for each case load its shard, take prefill
    logits and greedy tokens; puts (rank, results or a traceback) on ``results``."""
    try:
        from engine.parallel.group import init_tp_group
        from engine.quality import prefill_logits
        from engine_testing.generation import greedy_generate

        torch.set_num_threads(1)
        group = init_tp_group("gloo", rank, TP, f"tcp://127.0.0.1:{port}", timedelta(seconds=60))
        out = {}
        try:
            for case, path in paths.items():
                runner = RankRunner(path, group)
                out[case] = {
                    # numpy: a tensor would travel as shared memory the exiting rank frees
                    "logits": prefill_logits(runner, prompts[case],
                                             return_all_logits=True).numpy(),
                    "tokens": greedy_generate(runner, prompts[case], NEW_TOKENS),
                    "weight_bytes": runner.weight_bytes, "kv_heads": runner.kv_heads,
                }
        finally:
            group.destroy()
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))
        raise


@pytest.fixture(scope="module")
def tp_run(tiny_model_factory, tiny_gguf_factory):
    """(HF directories, prompts, rank -> results) of every case; the ranks read the GGUF file
    where the case says so."""
    paths, prompts, read = case_inputs(CASES, PROMPTS, tiny_model_factory, tiny_gguf_factory)
    return paths, prompts, run_spawned_ranks(rank_main, TP, (read, prompts), "tp", TIMEOUT_S)


@pytest.mark.usefixtures("single_torch_thread")
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_whole_model(tp_run, case, registries, cpu_device):
    from engine.runner import ModelRunner

    paths, prompts, got = tp_run
    hf, ref_logits, ref_tokens = hf_reference(paths[case], prompts[case], NEW_TOKENS)
    whole = ModelRunner(paths[case], registries=registries, device=cpu_device, dtype="float32")
    for rank in range(TP):
        out = got[rank][case]
        out["logits"] = torch.from_numpy(out["logits"])
        # every rank ends with the full logits (vocab-parallel head all-gathered): same tokens
        assert out["logits"].shape == ref_logits.shape
        assert_close_logits(out["logits"], ref_logits, LOGIT_TOL)
        assert out["tokens"] == ref_tokens
        # each rank holds its shard only: about half the weights (norms are replicated)
        assert 0.45 * whole.weight_bytes < out["weight_bytes"] < 0.55 * whole.weight_bytes
    kv = hf.config.num_key_value_heads
    assert got[0][case]["kv_heads"] == max(1, kv // TP)  # 2 -> 1 each; 1 -> replicated


def test_strategies_registered(registries):
    from engine.device import DeviceInfo, cpu_device

    gloo, nccl = (registries.parallel.get(n) for n in ("gloo", "nccl"))
    assert (gloo.obj.backend, nccl.obj.backend) == ("gloo", "nccl")
    assert (gloo.obj.device_type, nccl.obj.device_type) == ("cpu", "cuda")
    assert gloo.unavailable_reason(cpu_device()) is None
    assert "needs CUDA GPUs" in nccl.unavailable_reason(cpu_device())
    gpu = DeviceInfo("cuda", "fake", (9, 0), 80 << 30, 80 << 30, True)
    assert nccl.unavailable_reason(gpu) in (None, "this torch build has no NCCL")


def test_heads_that_do_not_split_are_refused():
    from engine.parallel.shard import kv_cut, rank_head_counts

    assert rank_head_counts(8, 2, 4) == (2, 1)
    assert kv_cut(2, 3, 4).index == 1  # ranks 2 and 3 share KV head 1
    with pytest.raises(EngineError, match="6 attention heads do not split over 4 ranks"):
        rank_head_counts(6, 2, 4)
    with pytest.raises(EngineError, match="3 KV heads cannot be replicated evenly over 4"):
        rank_head_counts(8, 3, 4)


def test_a_rank_loads_the_checkpoints_slices(tiny_model_factory, registries):
    """Rank 1 of 2, loaded in this process (loading needs no collective): every sharded
    weight is its slice of the checkpoint tensor; the padding row past a vocabulary of 511 is
    zero; the one KV head is replicated whole."""
    from safetensors.torch import load_file

    from engine.models.checkpoint import open_checkpoint
    from engine.models.config import ModelConfig
    from engine.models.loader import load_model
    from engine.parallel.group import TPGroup
    from engine.runner import resolve_model_class

    arch, kw, _ = CASES["kv_replicated"]
    path = tiny_model_factory(arch, **kw)
    ckpt = open_checkpoint(path)
    config = ModelConfig.from_checkpoint(ckpt, registries.models)
    model = load_model(resolve_model_class(registries, arch), config, ckpt, torch.float32,
                       tp=TPGroup(rank=1, size=2))
    full = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            full.update(load_file(os.path.join(path, f)))
    embed = model.model.embed_tokens.weight
    assert embed.shape[0] == 256
    assert torch.equal(embed[:255], full["model.embed_tokens.weight"][256:])
    assert not embed[255].any()
    assert model.lm_head.weight is embed  # tied: the head shares the rank's vocab rows
    attn, q_rows = model.model.layers[0].self_attn, config.num_heads * config.head_dim // 2
    pre = "model.layers.0.self_attn."
    q, k, v = attn.qkv_proj.weight.split([q_rows, config.head_dim, config.head_dim])
    assert torch.equal(q, full[pre + "q_proj.weight"][q_rows:])
    assert torch.equal(k, full[pre + "k_proj.weight"])
    assert torch.equal(v, full[pre + "v_proj.weight"])
    assert torch.equal(attn.qkv_proj.bias[:q_rows], full[pre + "q_proj.bias"][q_rows:])
    assert torch.equal(attn.o_proj.weight, full[pre + "o_proj.weight"][:, q_rows:])
    mlp, rows = model.model.layers[0].mlp, config.intermediate_size // 2
    pre = "model.layers.0.mlp."
    assert torch.equal(mlp.gate_up_proj.weight[rows:], full[pre + "up_proj.weight"][rows:])
    assert torch.equal(mlp.down_proj.weight, full[pre + "down_proj.weight"][:, rows:])


def test_a_model_whose_heads_do_not_split_is_refused_at_build(tiny_model_dir, registries):
    from engine.models.checkpoint import open_checkpoint
    from engine.models.config import ModelConfig
    from engine.models.loader import load_model
    from engine.parallel.group import TPGroup
    from engine.runner import resolve_model_class

    ckpt = open_checkpoint(tiny_model_dir)
    config = ModelConfig.from_checkpoint(ckpt, registries.models)
    with pytest.raises(EngineError, match="4 attention heads do not split over 3 ranks; use a "
                                          "--tp-size that divides 4"):
        load_model(resolve_model_class(registries, config.architecture), config, ckpt,
                   torch.float32, tp=TPGroup(rank=0, size=3))
