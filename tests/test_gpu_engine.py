"""The whole engine on a CUDA GPU against HF transformers: greedy tokens equal, with and without
CUDA graphs, for the backends that run float32 (triton, torch_native). Skipped without a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TEXTS = ["Beautiful is better than ugly.", "Simple is better", "In the face of ambiguity,"]


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("graphs", [False, True])
def test_engine_on_cuda_equals_hf_greedy(tiny_model_factory, backend, graphs):
    import transformers

    from engine import Engine

    if backend == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    path = tiny_model_factory("qwen2_bias_window")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval().cuda()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    engine = Engine(path, device="cuda", dtype="float32", attention_backend=backend,
                    disable_cuda_graph=not graphs, cuda_graph_max_bs=4, max_total_tokens=4096)
    assert (engine.runner.cuda_graphs is not None) == (graphs and backend == "triton")
    prompts = [tok(t).input_ids for t in TEXTS]
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16,
                                                               "temperature": 0.0,
                                                               "ignore_eos": True})
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]).cuda(), max_new_tokens=16, do_sample=False,
                          pad_token_id=2)
        assert out["output_ids"] == ref[0, len(p):].tolist()
    if engine.runner.cuda_graphs is not None:
        assert engine.runner.cuda_graphs.replays > 0
