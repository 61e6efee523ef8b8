"""CUDA-graph plumbing that needs no GPU: the captured sizes, the sizing report's room for the
graphs, the flags, and what a CPU start says. (Capture and replay themselves are proven with the
triton backend's tests: on a GPU with real graphs, on a CPU with the EagerGraph stand-in.)"""

from __future__ import annotations

import logging

import click
import torch
import pytest
from click.testing import CliRunner

from engine.config import ConfigError, EngineConfig
from engine.cuda_graph import capture_sizes, estimate_graph_bytes
from engine.device import DeviceInfo
from engine.memory.sizing import plan
from engine.registry import EngineError
from engine_cli.main import cli
from engine_cli.options import IntList

GIB = 1 << 30
H100 = DeviceInfo("cuda", "NVIDIA H100", (9, 0), 80 * GIB, 79 * GIB, True)


def test_capture_sizes_follow_sglangs_ladder_up_to_the_max():
    assert capture_sizes(1) == [1]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(40) == [1, 2, 4, 8, 12, 16, 24, 32, 40]
    assert capture_sizes(45)[-3:] == [32, 40, 45]
    assert capture_sizes(160, [8, 1, 8, 3]) == [1, 3, 8]


def sizing(config, device=H100, graph_bytes=lambda bs: bs * (100 << 20)):
    return plan(config, device, weight_bytes=16 * GIB, kv_bytes_per_token=128 << 10,
                kv_dtype="auto", model_context_len=8192, graph_bytes=graph_bytes)


def test_default_fraction_leaves_room_for_the_graphs():
    # 160 graphs' rows at 100 MiB each: 15.6 GiB of the 80 must stay outside the static share
    report = sizing(EngineConfig())
    assert report.cuda_graph_max_bs == 160 and report.cuda_graph_reserve_bytes == 160 * (100 << 20)
    assert report.mem_fraction_static == 0.804  # below the 0.88 default
    assert 80 * GIB * (1 - report.mem_fraction_static) >= report.cuda_graph_reserve_bytes
    line = next(x for x in report.lines() if x.startswith("cuda graph:"))
    assert "decode batches up to 160 requests, about 15.62 GiB" in line
    assert not any(x.startswith("warning") for x in report.lines())
    small = sizing(EngineConfig(), graph_bytes=lambda bs: bs << 20)
    assert small.mem_fraction_static == 0.88  # a small reserve keeps the default


def test_a_set_fraction_is_kept_and_a_tight_one_is_warned_about():
    report = sizing(EngineConfig(mem_fraction_static=0.95))
    assert report.mem_fraction_static == 0.95
    assert ("warning: that may not fit: lower --mem-fraction-static or --cuda-graph-max-bs "
            "(or --disable-cuda-graph)") in report.lines()
    assert not any(x.startswith("warning") for x in
                   sizing(EngineConfig(mem_fraction_static=0.95, cuda_graph_max_bs=16)).lines())


def test_graph_sizes_are_capped_and_switched_off():
    capped = sizing(EngineConfig(max_running_requests=24))
    assert capped.cuda_graph_max_bs == 24 and capped.cuda_graph_reserve_bytes == 24 * (100 << 20)
    assert sizing(EngineConfig(cuda_graph_bs=[1, 2, 48])).cuda_graph_max_bs == 48
    for off in (sizing(EngineConfig(disable_cuda_graph=True)),
                sizing(EngineConfig(), DeviceInfo("cpu", "CPU", None, 8 * GIB, 64 * GIB))):
        assert off.cuda_graph_max_bs == 0 and off.cuda_graph_reserve_bytes == 0
        assert not any(x.startswith("cuda graph") for x in off.lines())


def test_estimate_grows_with_batch_and_vocabulary():
    class Config:
        hidden_size, intermediate_size, vocab_size = 4096, 14336, 128256

    one, many = estimate_graph_bytes(Config, 2, 1), estimate_graph_bytes(Config, 2, 160)
    per_row = (6 * 4096 + 3 * 14336) * 2 + 128256 * 6
    assert many - one == 159 * per_row


def test_flags_parse_and_bad_values_are_refused():
    assert IntList().convert("1,2, 4 8", None, None) == [1, 2, 4, 8]
    with pytest.raises(click.BadParameter, match="not a list of integers"):
        IntList().convert("1,two", None, None)
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs must be >= 1"):
        EngineConfig(cuda_graph_max_bs=0).validate()
    with pytest.raises(ConfigError, match="--cuda-graph-bs sizes must be >= 1"):
        EngineConfig(cuda_graph_bs=[0, 4]).validate()
    out = CliRunner().invoke(cli, ["serve", "--help"]).output
    for flag in ("--cuda-graph-max-bs", "--cuda-graph-bs", "--disable-cuda-graph",
                 "--enforce-eager"):
        assert flag in out
    bad = CliRunner().invoke(cli, ["generate", "--cuda-graph-bs", "x", "hi"])
    assert bad.exit_code == 2 and "not a list of integers" in bad.output


def test_a_cpu_start_says_graphs_are_off(tiny_model_factory, caplog):
    from engine import Engine

    with caplog.at_level(logging.INFO, logger="engine"):
        engine = Engine(tiny_model_factory("LlamaForCausalLM"), device="cpu",
                        max_total_tokens=256, cuda_graph_max_bs=8)
    assert engine.runner.cuda_graphs is None and engine.sizing.cuda_graph_max_bs == 0
    assert "cuda graph: off (CUDA graphs need a CUDA GPU; this is a CPU)" in caplog.messages


def test_the_request_table_is_int32_and_counted(tiny_model_factory):
    """req_to_token holds int32 slots, and its bytes (a row per running request + the scratch
    row, context_len wide) are reported and taken from the KV budget."""
    report = sizing(EngineConfig(max_model_len=8192), graph_bytes=None)
    assert report.req_to_token_bytes == (report.max_running_requests + 1) * 8192 * 4
    assert "request table 128.0 MiB (req_to_token)" in report.lines()[2]
    from engine import Engine

    engine = Engine(tiny_model_factory("LlamaForCausalLM"), device="cpu", max_total_tokens=256)
    table = engine.runner.kv_pool.req_to_token
    assert table.dtype == torch.int32
    assert table.numel() * 4 == engine.sizing.req_to_token_bytes


def test_mem_fraction_static_is_a_share_of_the_gpus_total_memory():
    """SGLang's and vLLM's meaning on a GPU: weights + KV pool get fraction x total, and what
    other processes use at start counts inside it (not a share of the memory free at start)."""
    busy = DeviceInfo("cuda", "NVIDIA H100", (9, 0), 80 * GIB, 60 * GIB, True)  # 20 GiB in use
    config = EngineConfig(mem_fraction_static=0.5, disable_cuda_graph=True, max_running_requests=1)
    report = sizing(config, busy)
    table = 2 * 8192 * 4
    per_token = 128 << 10
    budget = (40 - 20 - 16) * GIB - table  # not 0.5 x 60 - 16
    assert report.kv_pool_bytes == budget // per_token * per_token
    assert ("mem_fraction_static=0.5 of the GPU's total memory (40.00 GiB for weights + KV pool "
            "+ request table)") in report.lines()[0]
    with pytest.raises(EngineError, match=r"0.4 x 80.00 GiB \(of the GPU's total memory\) is "
                                          r"less than the 16.00 GiB of weights plus the 20.00 "
                                          r"GiB other processes already use"):
        sizing(EngineConfig(mem_fraction_static=0.4, disable_cuda_graph=True), busy)
    cpu = DeviceInfo("cpu", "CPU", None, 24 * GIB, 20 * GIB)
    line = sizing(EngineConfig(mem_fraction_static=0.9), cpu).lines()[0]
    assert "24.00 GiB total, 20.00 GiB available at start" in line
    assert "mem_fraction_static=0.9 of the RAM available at start (18.00 GiB" in line
