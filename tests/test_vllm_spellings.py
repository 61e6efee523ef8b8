"""vLLM's spellings of the memory and batching knobs: the same knob as SGLang's, as flags of
`engine serve` / `engine generate` and as Engine(...) keywords; two spellings that disagree are
an error naming both."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from engine.config import ConfigError, EngineConfig
from engine_cli.main import cli


def cfg(**kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(**kwargs)


def test_each_vllm_name_sets_the_sglang_knob():
    assert cfg(gpu_memory_utilization=0.5).mem_fraction_static == 0.5
    assert cfg(max_num_seqs=7).max_running_requests == 7
    # vLLM's default is chunked prefill: the step's token budget
    assert cfg(max_num_batched_tokens=2048).chunked_prefill_size == 2048
    assert cfg(max_num_batched_tokens=2048, enable_chunked_prefill=True).chunked_prefill_size \
        == 2048
    # without chunked prefill: no chunking, and the prompt tokens of a step
    off = cfg(enable_chunked_prefill=False, max_num_batched_tokens=4096)
    assert off.chunked_prefill_size == -1 and off.max_prefill_tokens == 4096
    assert cfg(enable_chunked_prefill=False).max_prefill_tokens == 16384
    # both spellings agreeing is fine
    assert cfg(gpu_memory_utilization=0.5, mem_fraction_static=0.5).mem_fraction_static == 0.5


@pytest.mark.parametrize("kwargs, message", [
    ({"gpu_memory_utilization": 0.5, "mem_fraction_static": 0.4},
     "--mem-fraction-static 0.4 and --gpu-memory-utilization 0.5 set the same knob"),
    ({"max_num_seqs": 8, "max_running_requests": 4},
     "--max-running-requests 4 and --max-num-seqs 8 set the same knob"),
    ({"max_num_batched_tokens": 1024, "chunked_prefill_size": 512},
     "--chunked-prefill-size 512 and --max-num-batched-tokens 1024 set the same knob"),
    ({"enable_chunked_prefill": False, "chunked_prefill_size": 512},
     "--no-enable-chunked-prefill and --chunked-prefill-size 512 contradict each other"),
    ({"enable_chunked_prefill": True, "chunked_prefill_size": -1},
     "--enable-chunked-prefill and --chunked-prefill-size -1 contradict each other"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 100, "max_prefill_tokens": 200},
     "--max-prefill-tokens 200 and --max-num-batched-tokens 100 set the same knob"),
    ({"gpu_memory_utilization": 1.5}, "--mem-fraction-static (--gpu-memory-utilization) must be"),
])
def test_disagreeing_spellings_are_refused_naming_both(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg(**kwargs)


def test_engine_keywords_and_flags(tiny_model_factory):
    from engine import Engine

    engine = Engine(tiny_model_factory("LlamaForCausalLM"), device="cpu", max_total_tokens=512,
                    max_num_seqs=3, max_num_batched_tokens=64)
    assert engine.sizing.max_running_requests == 3 and engine.sizing.chunked_prefill_size == 64
    for command in ("serve", "generate"):
        out = CliRunner().invoke(cli, [command, "--help"]).output
        for flag in ("--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens",
                     "--enable-chunked-prefill / --no-enable-chunked-prefill", "--max-model-len"):
            assert flag in out, (command, flag)
    bad = CliRunner().invoke(cli, ["serve", "--max-num-seqs", "8", "--max-running-requests",
                                   "4"])
    assert bad.exit_code == 2
    assert "--max-running-requests 4 and --max-num-seqs 8 set the same knob" in bad.output


def test_preemption_logs_vllms_warning_with_the_cumulative_count(tiny_model_factory, caplog):
    """A retraction logs SGLang's line and, for the 1st, 51st, ... preempted request, vLLM's
    warning in its wording with our flags and the cumulative count."""
    import logging
    import re

    from engine import Engine
    from engine.stats import StatLogger

    engine = Engine(tiny_model_factory("LlamaForCausalLM"), device="cpu", max_total_tokens=160,
                    schedule_conservativeness=0.1)
    prompts = [[5 + (7 * i + j) % 400 for j in range(20 + i)] for i in range(8)]
    with caplog.at_level(logging.WARNING, logger="engine"):
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 40,
                                                            "ignore_eos": True})
    messages = caplog.messages
    assert any(m.startswith("decode out of memory happened") for m in messages)
    vllm = [m for m in messages if m.startswith("Sequence group")]
    assert re.fullmatch(
        r"Sequence group req-\d+ is preempted by PreemptionMode\.RECOMPUTE mode because there is "
        r"not enough KV cache space\. This can affect the end-to-end performance\. Increase "
        r"--mem-fraction-static \(--gpu-memory-utilization\) or --max-total-tokens to provide "
        r"more KV cache memory\. total_num_cumulative_preemption=1", vllm[0]), vllm
    assert len(vllm) == 1 + (engine.scheduler.counters.retracted_reqs - 1) // 50
    log = StatLogger(40)  # every 50th, from the first, with the running total
    with caplog.at_level(logging.WARNING, logger="engine"):
        caplog.clear()
        for i in range(12):
            log.retraction([f"r{i}-{j}" for j in range(10)], 0.5, 0.6)
    counts = [m.rsplit("=", 1)[1] for m in caplog.messages if m.startswith("Sequence group")]
    assert counts == ["1", "51", "101"]


@pytest.mark.parametrize("spelling, name", [("fp8", "fp8_e4m3"), ("bfloat16", "bf16"),
                                            ("float16", "fp16"), ("fp8_e5m2", "fp8_e5m2")])
def test_kv_cache_dtype_spellings_of_vllm_and_sglang(tiny_model_factory, spelling, name):
    """vLLM's --kv-cache-dtype fp8 is fp8_e4m3; both anchors take bfloat16."""
    from engine import Engine

    assert cfg(kv_cache_dtype=spelling).kv_cache_dtype == name
    engine = Engine(tiny_model_factory("LlamaForCausalLM"), device="cpu", max_total_tokens=512,
                    kv_cache_dtype=spelling)
    assert engine.config.kv_cache_dtype == name
    assert engine.generate("Hi", {"max_new_tokens": 2, "temperature": 0})["output_ids"]
    out = CliRunner().invoke(cli, ["serve", "--help"]).output
    assert "fp8|bfloat16" in out.replace("\n", "").replace(" ", "")
    bad = CliRunner().invoke(cli, ["serve", "--kv-cache-dtype", "fp9"])
    assert bad.exit_code == 2 and "fp9" in bad.output
