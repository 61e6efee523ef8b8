"""The fused MoE Triton kernel (layers/moe_align.py, moe_triton.py, moe_fused.py) against the
CPU path of ``SparseMoE`` (its per-expert loop), run on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, float32 and float16 only there): the block layout against a plain
reference, the fused output for tokens 1/7/64, top-k 2/3, renormalized or not, a rank's experts
(``AbsentExpert``s, cut intermediate), Mixtral's float32 routing weights; which path the start
log's line names and why. On a CUDA machine the ``gpu`` test runs the same on the GPU."""

from __future__ import annotations


import pytest
import torch

from engine_testing.triton_device import triton_device

DEVICE = triton_device()  # before the kernels' module is imported (the interpreter)
GPU = DEVICE == "cuda"

from engine.layers.moe import AbsentExpert, Expert, SparseMoE
from engine.layers.moe_align import max_entries, moe_align_block_size
from engine.layers.moe_fused import MOE_KERNEL_ENV, fuse_layer, fuse_moe_layers, layer_reason
from torch import nn

pytestmark = pytest.mark.usefixtures("single_torch_thread")
# float16: max |fused - loop| <= HALF_TOL * max(1, max |loop|). Both round the gate_up output
# and the SiLU-and-mul to float16; the loop also rounds each expert's down output and its
# weighted product to float16 before the float32 sum, the kernel keeps them float32 (measured
# <= 5.2e-4 relative on these cases: half a float16 ulp of the largest output)
HALF_TOL = 2e-3


def reference_layout(ids: torch.Tensor, num_experts: int, block: int, local=None):
    """(entries, block experts) the plain way: per expert, its pairs in order, then padding."""
    flat = ids.reshape(-1).tolist()
    entries, experts = [], []
    for e in range(num_experts):
        pairs = [p for p, x in enumerate(flat) if x == e]
        if not pairs:
            continue
        pairs += [len(flat)] * (-len(pairs) % block)
        entries += pairs
        experts += [e if local is None else int(local[e])] * (len(pairs) // block)
    return entries, experts


@pytest.mark.parametrize("tokens,k,experts,block", [(1, 2, 8, 16), (7, 3, 8, 16),
                                                    (64, 2, 8, 64), (33, 4, 5, 4),
                                                    (5, 1, 64, 16)])
def test_align_block_size_matches_a_plain_reference(tokens, k, experts, block):
    gen = torch.Generator().manual_seed(tokens * 100 + k)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    local = torch.where(torch.arange(experts) % 3 == 1, -1, torch.arange(experts) // 2)
    for loc in (None, local):
        layout = moe_align_block_size(ids, experts, block, loc)
        entries, block_experts = reference_layout(ids, experts, block, loc)
        n = int(layout.num_padded)
        assert n == len(entries) and n % block == 0
        assert layout.sorted_pairs.numel() == max_entries(tokens * k, experts, block)
        assert layout.sorted_pairs[:n].tolist() == entries
        assert (layout.sorted_pairs[n:] == tokens * k).all()  # padding past the runs
        assert layout.block_experts[:n // block].tolist() == block_experts
        assert (layout.block_experts[n // block:] == -1).all()
        # every (token, expert) pair exactly once
        real = layout.sorted_pairs[layout.sorted_pairs < tokens * k]
        assert sorted(real.tolist()) == list(range(tokens * k))


def make_moe(hidden, inter, experts, k, renormalize, dtype, seed=0, float32_weights=False,
             expert_list=None):
    torch.manual_seed(seed)
    moe = SparseMoE(hidden, inter, experts, k, renormalize, float32_weights=float32_weights,
                    experts=expert_list)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    return moe.to(DEVICE, dtype)


def check_fused(moe, x, dtype):
    expected = moe.routed(x)  # the per-expert loop
    assert layer_reason(moe) is None
    fuse_layer(moe)
    got = moe.routed(x)
    assert got.dtype == expected.dtype == torch.float32 and got.shape == x.shape
    scale = max(1.0, expected.abs().max().item())
    tol = 1e-5 if dtype == torch.float32 else HALF_TOL
    assert (got - expected).abs().max().item() <= tol * scale
    # the loop still runs on the stacked weights (views of them, one copy)
    fused, moe.fused = moe.fused, None
    assert torch.equal(moe.routed(x), expected)
    moe.fused = fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_fused_equals_the_cpu_path(tokens, k, renormalize, dtype):
    moe = make_moe(32, 48, 8, k, renormalize, dtype, seed=tokens + k)
    x = torch.randn(tokens, 32, device=DEVICE).to(dtype)
    check_fused(moe, x, dtype)
    first = moe.experts[0]
    assert first.gate_up_proj.weight.data_ptr() == moe.fused.w13.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_ranks_experts_only(dtype):
    """--ep-size: whole experts of its own, the others AbsentExpert (their pairs add zero);
    --tp-size: each expert's intermediate slice (the sum stays partial: reduce completes it)."""
    held = [AbsentExpert() if e % 3 == 1 else Expert(32, 24) for e in range(8)]
    moe = make_moe(32, 24, 8, 2, True, dtype, seed=3, expert_list=nn.ModuleList(held))
    x = torch.randn(40, 32, device=DEVICE).to(dtype)
    check_fused(moe, x, dtype)
    assert moe.fused.w13.shape == (5, 48, 32) and moe.fused.local.tolist() == \
        [0, -1, 1, 2, -1, 3, 4, -1]


def test_float32_routing_weights_on_a_half_model():
    """Mixtral's routing weights stay float32 (float32_weights) while the experts are half."""
    moe = make_moe(32, 48, 8, 2, True, torch.float16, seed=5, float32_weights=True)
    check_fused(moe, torch.randn(9, 32, device=DEVICE).half(), torch.float16)


def test_the_start_log_line_says_which_path_and_why(monkeypatch):
    model = nn.ModuleList([make_moe(32, 48, 8, 2, True, torch.float32, seed=s)
                           for s in range(2)])
    line = fuse_moe_layers(model, torch.device("cpu"))
    assert line == ("MoE layers: per-expert GEMMs, 2 layers (the cpu path; the fused Triton "
                    "kernel is for CUDA)")
    monkeypatch.setenv(MOE_KERNEL_ENV, "per_expert")
    assert "ENGINE_MOE_KERNEL=per_expert" in fuse_moe_layers(model, torch.device("cuda"))
    assert all(m.fused is None for m in model)
    monkeypatch.delenv(MOE_KERNEL_ENV)
    if not GPU:  # an expert packed for a CPU kernel is refused for the fused one, in words
        model[1].experts[0].down.prepack("onednn")
        assert "packed for a CPU kernel" in fuse_moe_layers(model, torch.device("cuda"))
        model[1] = make_moe(32, 48, 8, 2, True, torch.float32, seed=1)
    # on CUDA (here: the interpreter standing in) every layer takes the fused path
    x = torch.randn(5, 32, device=DEVICE)
    expected = [m(x) for m in model]
    line = fuse_moe_layers(model, torch.device("cuda"))
    assert line.startswith("MoE layers: fused Triton kernel") and "2 layers, 8 experts, " \
        "float32 weights stacked [E, 2I, H] [8, 96, 32] / [E, H, I] [8, 32, 48]" in line
    for m, ref in zip(model, expected):
        assert torch.allclose(m(x), ref, atol=1e-5)


def test_the_cpu_runner_says_it_runs_the_per_expert_path(tiny_model_factory, monkeypatch):
    from engine.device import detect_device
    from engine.plugins import get_registries
    from engine.runner import ModelRunner
    from engine_testing.checkpoints import MOE_CASES

    arch, overrides = MOE_CASES["qwen3_moe_mlp_only"]
    # without a plugin's grouped GEMM (that path: plugins/cpu_kernels/tests/test_grouped.py)
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "torch")
    runner = ModelRunner(tiny_model_factory(arch, **overrides), registries=get_registries(),
                         device=detect_device("cpu"), dtype="float32")
    assert runner.moe_kernel.startswith("MoE layers: per-expert GEMMs, ")
    assert "ENGINE_LINEAR_KERNEL=torch keeps the core's own kernels" in runner.moe_kernel


@pytest.mark.parametrize("case", ["qwen3", "deepseek_v3"])
def test_whole_models_logits_on_the_fused_path(case, tiny_model_factory, monkeypatch):
    """A tiny Qwen3-MoE and DeepSeek-V3 (grouped top-k, sigmoid scores, the correction bias,
    shared experts): prompt logits with every sparse layer fused equal the per-expert loop's."""
    from engine.device import detect_device
    from engine.plugins import get_registries
    from engine.quality import prefill_logits
    from engine.runner import ModelRunner
    from engine_testing.checkpoints import DEEPSEEK_CASES, MOE_CASES

    arch, overrides = (MOE_CASES["qwen3_moe_mlp_only"] if case == "qwen3"
                       else DEEPSEEK_CASES["v3_noaux_tc"])
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "plain")  # plain weights, as on a GPU
    runner = ModelRunner(tiny_model_factory(arch, **overrides), registries=get_registries(),
                         device=detect_device(DEVICE), dtype="float32")
    runner.init_kv_pool(1024)
    prompts = [[5, 17, 301, 42, 9, 77, 12], [8], list(range(40, 100, 3))]
    expected = prefill_logits(runner, prompts, return_all_logits=True)
    line = fuse_moe_layers(runner.model, torch.device("cuda"))
    assert "fused Triton kernel" in line
    got = prefill_logits(runner, prompts, return_all_logits=True)
    assert (got - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (the CPU runs it under the interpreter)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_fused_on_cuda_equals_the_per_expert_path(tokens, dtype):
    moe = make_moe(64, 96, 8, 2, True, dtype, seed=tokens)
    x = torch.randn(tokens, 64, device=DEVICE).to(dtype)
    expected = moe.routed(x)
    fuse_layer(moe)
    got = moe.routed(x)
    scale = max(1.0, expected.abs().max().item())
    tol = {torch.float32: 1e-5, torch.float16: HALF_TOL, torch.bfloat16: 1.6e-2}[dtype]
    assert (got - expected).abs().max().item() <= tol * scale


@pytest.mark.parametrize("case", ["qwen3", "deepseek_v3"])
def test_decode_graphs_capture_a_fused_moe_model(case, tiny_model_factory, registries,
                                                 monkeypatch):
    """A Qwen3-MoE or DeepSeek-V3 (MLA on the triton backend: the one MLA backend that runs in
    a graph) whose sparse layers all take the fused kernel is captured: every decode step
    replays a graph of 1, 2 or 4 requests (one padding row routed like any token) and the
    greedy tokens equal HF's (on a CPU: the kernel under the interpreter, the EagerGraph
    stand-in re-running the forward over the graph's fixed buffers); on the per-expert loop
    the model says why it is not."""
    import engine.layers.moe_fused as moe_fused
    from engine.device import DeviceInfo
    from engine_testing.checkpoints import DEEPSEEK_CASES, MOE_CASES
    from engine_testing.generation import greedy_matches_hf
    from engine_attention_triton.backend import TritonBackend

    arch, overrides = (MOE_CASES["qwen3_moe_mlp_only"] if case == "qwen3"
                       else DEEPSEEK_CASES["v3_noaux_tc"])
    path = tiny_model_factory(arch, **overrides)
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "plain")  # plain weights, as on a GPU
    if not GPU:  # the CPU's own MoE paths out of the way: the fused kernel, as on a GPU
        import engine.runner

        monkeypatch.setattr(moe_fused, "device_reason", lambda device: None)
        monkeypatch.setattr(engine.runner, "group_moe_layers", lambda *args: "")
    device = DeviceInfo("cuda", "GPU", (9, 0)) if GPU else DeviceInfo("cpu", "CPU")
    runner = greedy_matches_hf(path, registries, TritonBackend, True, device, max_new_tokens=6)
    assert "fused Triton kernel" in runner.moe_kernel
    assert runner.model.cuda_graph_unsupported is None
    for m in runner.model.modules():
        if isinstance(m, SparseMoE):
            m.fused = None
    assert "per-expert" in runner.model.cuda_graph_unsupported


def test_prompt_pieces_capture_a_fused_moe_model(tiny_model_factory, registries, monkeypatch):
    """Piecewise CUDA graphs of a Qwen3-MoE on the fused kernel: prompts of 27 tokens (padded to
    32) run through the pieces and give the eager forward's logits (on a CPU: the kernel under
    the interpreter, the EagerGraph stand-in)."""
    import engine.layers.moe_fused as moe_fused
    from engine.device import DeviceInfo
    from engine.quality import prefill_logits
    from engine.runner import ModelRunner
    from engine_testing.checkpoints import MOE_CASES
    from engine_testing.graphs import EagerGraph
    from engine_attention_triton.backend import TritonBackend

    arch, overrides = MOE_CASES["qwen3_moe_mlp_only"]
    path = tiny_model_factory(arch, **overrides)
    monkeypatch.setenv("ENGINE_LINEAR_KERNEL", "plain")
    if not GPU:
        import engine.runner

        monkeypatch.setattr(moe_fused, "device_reason", lambda device: None)
        monkeypatch.setattr(engine.runner, "group_moe_layers", lambda *args: "")
    device = DeviceInfo("cuda", "GPU", (9, 0)) if GPU else DeviceInfo("cpu", "CPU")
    runner = ModelRunner(path, registries=registries, device=device, dtype="float32",
                         attention_factory=TritonBackend)
    runner.init_kv_pool(1024, page_size=16)
    prompts = [[5, 17, 301, 42, 9], list(range(40, 49)), list(range(100, 139, 3))]
    expected = prefill_logits(runner, prompts, return_all_logits=True)
    runner.init_piecewise_cuda_graphs(64, graph_cls=None if GPU else EagerGraph)
    got = prefill_logits(runner, prompts, return_all_logits=True)
    assert runner.last_piecewise_graph
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
