"""The dp front's pieces without replicas: its flags, a replica's command line, /metrics
aggregation, the routing text."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from engine.router.aggregate import aggregate
from engine.router.front import routing_text
from engine.router.replicas import Replica
from engine_cli.main import cli
from engine_cli.serve_cmd import replica_args, serve_command


def test_router_flags_without_dp_size_are_refused():
    result = CliRunner().invoke(cli, ["serve", "--router-policy", "round_robin"])
    assert result.exit_code == 2
    assert "--router-policy only apply with --dp-size > 1" in result.output


def test_cache_aware_thresholds_with_another_policy_are_refused():
    result = CliRunner().invoke(cli, ["serve", "--dp-size", "2", "--router-policy",
                                      "round_robin", "--router-balance-abs-threshold", "4"])
    assert result.exit_code == 2
    assert "--router-balance-abs-threshold: only cache_aware uses them" in result.output


def test_unknown_router_policy_says_what_is_registered():
    result = CliRunner().invoke(cli, ["serve", "--dp-size", "2", "--router-policy", "cache"])
    assert result.exit_code == 2
    assert "Unknown routing policy 'cache'" in result.output and "cache_aware" in result.output


def test_bad_engine_flags_are_refused_before_replicas_start():
    result = CliRunner().invoke(cli, ["serve", "--dp-size", "2", "--page-size", "0"])
    assert result.exit_code == 2 and "--page-size must be >= 1" in result.output


def test_in_process_engine_config_refuses_dp_size():
    from engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="engine serve --dp-size 2"):
        EngineConfig(dp_size=2).validate()
    with pytest.raises(ConfigError, match="--dp-size must be >= 1"):
        EngineConfig(dp_size=0).validate()


def test_replica_args_pass_every_given_flag_but_the_fronts(tmp_path):
    argv = ["--model", str(tmp_path), "--dp-size", "2", "--port", "1234", "--host", "0.0.0.0",
            "--router-policy", "round_robin", "--max-total-tokens", "512", "--disable-radix-cache",
            "--no-enable-chunked-prefill", "--cuda-graph-bs", "1 2 4", "--api-key", "k"]
    with click.Context(serve_command) as ctx:
        serve_command.parse_args(ctx, argv)
        args = replica_args(ctx)
    # the API key is not among them: it goes in the replicas' environment (ENGINE_API_KEY)
    assert args == ["--model", str(tmp_path), "--max-total-tokens", "512",
                    "--disable-radix-cache", "--cuda-graph-bs", "1,2,4",
                    "--no-enable-chunked-prefill"]


def test_metrics_report_each_replica_and_the_total():
    def text(prompt, cached, usage):
        return (f"# TYPE engine:cache_hit_rate gauge\n"  # before the counters, as served
                f'engine:cache_hit_rate{{model_name="m"}} {cached / prompt}\n'
                f"# HELP engine:prompt_tokens_total Prompt tokens.\n"
                f"# TYPE engine:prompt_tokens_total counter\n"
                f'engine:prompt_tokens_total{{model_name="m"}} {prompt}\n'
                f'engine:cached_tokens_total{{model_name="m"}} {cached}\n'
                f"# TYPE engine:token_usage gauge\n"
                f'engine:token_usage{{model_name="m"}} {usage}\n')
    replicas = [Replica(0, 1), Replica(1, 2), Replica(2, 3, alive=False, error="gone")]
    replicas[0].routed, replicas[1].routed = 3, 5
    out = aggregate({0: text(100, 90, 0.2), 1: text(300, 0, 0.4)}, replicas).splitlines()
    assert 'engine:prompt_tokens_total{dp_rank="0",model_name="m"} 100.0' in out
    assert 'engine:prompt_tokens_total{dp_rank="1",model_name="m"} 300.0' in out
    assert 'engine:prompt_tokens_total{model_name="m"} 400.0' in out
    assert 'engine:token_usage{model_name="m"} 0.30000000000000004' in out  # a mean, not a sum
    assert 'engine:cache_hit_rate{model_name="m"} 0.225' in out  # 90 / 400 tokens
    assert 'engine:dp_replica_up{dp_rank="2"} 0' in out and "engine:dp_replica_up 2" in out
    assert "engine:dp_routed_requests_total 8" in out
    assert out.count("# TYPE engine:prompt_tokens_total counter") == 1


@pytest.mark.parametrize("body, text", [
    (b'{"prompt": "hello"}', "hello"),
    (b'{"text": "hi", "sampling_params": {}}', "hi"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', '[{"role": "user", "content": "x"}]'),
    (b'{"input_ids": [1, 2]}', "[1, 2]"),
    (b"not json", ""),
])
def test_routing_text(body, text):
    assert routing_text(body) == text
