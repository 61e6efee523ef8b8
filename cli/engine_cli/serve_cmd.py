"""`engine serve`: every engine knob as an SGLang-spelled flag, plus the plugins' own options."""

from __future__ import annotations

import logging

import click

from engine_cli.options import EngineCommand, RegistryChoice, engine_options, given, split_options

SERVER_FLAGS = ("host", "port", "api_key", "served_model_name", "log_level",
                "max_request_bytes", "shutdown_grace_period", "record_trace")
# the dp front's own flags: not passed on to its replicas
ROUTER_FLAGS = ("dp_size", "router_policy", "router_balance_abs_threshold",
                "router_balance_rel_threshold", "router_cache_threshold")
# (the API key reaches the replicas in their environment, not on their command line)
FRONT_ONLY = (*ROUTER_FLAGS, "host", "port", "api_key")


@click.command("serve", cls=EngineCommand, context_settings={"show_default": True})
@engine_options
@click.option("--max-queued-requests", type=int,
              help="Answer 503 when this many requests already wait.  [default: no limit]")
@click.option("--host", default="127.0.0.1")
@click.option("--port", default=30000, type=int)
@click.option("--api-key", envvar="ENGINE_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every route but /health (the "
                   "variable keeps the key out of the command line, which /proc shows).")
@click.option("--served-model-name", help="The model name clients use.  [default: --model; "
                                          "SmolLM2-135M-Instruct for the default model]")
@click.option("--log-level", default="info",
              type=click.Choice(["debug", "info", "warning", "error", "critical"]))
@click.option("--max-request-bytes", default=32 << 20, type=click.IntRange(min=1),
              help="Larger request bodies get a 413.")
@click.option("--shutdown-grace-period", default=30.0, type=click.FloatRange(min=0),
              help="Seconds in-flight requests get to finish after SIGTERM/SIGINT.")
@click.option("--record-trace", type=click.Path(dir_okay=False, writable=True),
              help="Append a JSONL line per finished request (arrival time since start, prompt "
                   "and output tokens): the trace `engine bench --dataset-name trace` replays.")
@click.option("--dp-size", "--data-parallel-size", "dp_size", default=1,
              type=click.IntRange(min=1),
              help="Engine replicas (processes), each with the whole model, behind one HTTP "
                   "front that routes every request to one of them.")
@click.option("--router-policy", default="cache_aware", type=RegistryChoice("routing"),
              help="How the --dp-size front picks a replica.")
@click.option("--router-balance-abs-threshold", default=32, type=click.IntRange(min=0),
              help="cache_aware: the load is imbalanced (route to the least loaded) when the "
                   "busiest replica has more than this many requests more than the idlest...")
@click.option("--router-balance-rel-threshold", default=1.0001, type=click.FloatRange(min=1),
              help="...and more than this many times as many.")
@click.option("--router-cache-threshold", default=0.5, type=click.FloatRange(0, 1),
              help="cache_aware: the share of a prompt a replica's prefix tree must match for "
                   "the prompt to go there (else to the replica with the smallest tree).")
def serve_command(**kwargs):
    """Serve a model over HTTP (OpenAI-compatible and SGLang-style routes)."""
    ctx = click.get_current_context()
    if kwargs["record_trace"] and (kwargs["dp_size"] > 1 or kwargs["node_rank"] > 0):
        raise click.UsageError("--record-trace records on a single engine server: not with "
                               "--dp-size > 1 (record on one replica's server) nor on a node "
                               "with --node-rank > 0 (node 0 serves HTTP; record there).")
    if kwargs["enable_dp_attention"] and kwargs["dp_attention_rank"] is None:
        _serve_dp_attention(ctx, kwargs)
        return
    if kwargs["dp_size"] > 1:
        if kwargs["nnodes"] > 1:
            raise click.UsageError("--nnodes with --dp-size: the dp front runs its replicas on "
                                   "this node only; start one multi-node engine per replica "
                                   "(each its own `engine serve --nnodes ...`) instead.")
        _serve_dp(ctx, kwargs)
        return
    router_only = [f"--{k.replace('_', '-')}" for k in ROUTER_FLAGS[1:] if given(ctx, k)]
    if router_only:
        raise click.UsageError(f"{', '.join(router_only)} only apply with --dp-size > 1 (the router "
                               f"of the replicas); drop them or give --dp-size.")
    for k in ROUTER_FLAGS:
        kwargs.pop(k)
    from engine.engine import Engine
    from engine.errors import EngineError
    from engine.server.launch import serve
    from engine.server.serving import ServerSettings

    config, server = split_options(kwargs, click.get_current_context().command.plugin_dests,
                                   SERVER_FLAGS)
    log_level = server.pop("log_level")
    logging.basicConfig(level=log_level.upper(), format="[%(asctime)s %(levelname)s] %(message)s")
    if config["node_rank"] > 0:  # a node of a multi-node engine: its ranks, no HTTP server
        _serve_node(config, log_level)
        return
    try:
        engine = Engine(**config)
    except EngineError as e:
        raise click.UsageError(str(e)) from None
    server["served_model_name"] = server["served_model_name"] or engine.model_name
    serve(engine, ServerSettings(model_path=engine.checkpoint.path, **server), log_level)


def _serve_node(config: dict, log_level: str) -> None:
    from engine.config import EngineConfig
    from engine.errors import EngineError
    from engine.ranks.launch import serve_node

    try:
        serve_node(EngineConfig.from_kwargs(**config), log_level)
    except EngineError as e:
        raise click.ClickException(str(e)) from None



def replica_args(ctx: click.Context, tp_size: int | None = None) -> list[str]:
    """The command line of one replica: every flag given to this command but the front's
    (``tp_size``: a --tp-size of its own instead of the one given)."""
    args: list[str] = [] if tp_size is None else ["--tp-size", str(tp_size)]
    for param in ctx.command.get_params(ctx):
        name = param.name
        if not isinstance(param, click.Option) or name in FRONT_ONLY or not given(ctx, name) \
                or (tp_size is not None and name == "tp_size"):
            continue
        value = ctx.params[name]
        if param.is_flag and param.secondary_opts:
            args.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.is_flag:
            if value:
                args.append(param.opts[0])
        elif value is not None:
            args += [param.opts[0], ",".join(map(str, value)) if isinstance(value, list)
                     else str(value)]
    return args


def _serve_dp_attention(ctx: click.Context, kwargs: dict) -> None:
    """--enable-dp-attention: the front and one replica per tp rank (its own process,
    requests, KV cache and scheduler), whose MoE layers run over all of them
    (engine/parallel/dp_attention.py); each replica learns its place from flags of its own."""
    from engine.config import EngineConfig
    from engine.errors import EngineError
    from engine.models.checkpoint import open_checkpoint
    from engine.models.config import ModelConfig
    from engine.models.default import default_model_path
    from engine.models.moe import dp_attention_problem
    from engine.net import free_port
    from engine.plugins import get_registries, load_plugins

    config, _ = split_options(dict(kwargs), ctx.command.plugin_dests, SERVER_FLAGS)
    ranks = config["tp_size"]
    try:  # the flags and the model, before any process starts
        engine_config = EngineConfig(**{k: v for k, v in config.items()
                                        if k not in ROUTER_FLAGS}, dp_size=1).validate()
        if kwargs["dp_size"] not in (1, ranks):
            raise EngineError(f"--dp-size {kwargs['dp_size']} with --enable-dp-attention: the "
                              f"data-parallel attention replicas are the --tp-size {ranks} "
                              f"ranks (SGLang's --dp equal to --tp); drop --dp-size or give "
                              f"{ranks}.")
        load_plugins()
        model = engine_config.model or default_model_path()
        problem = dp_attention_problem(ModelConfig.from_checkpoint(
            open_checkpoint(model), get_registries().models), ranks, engine_config.ep_size)
        if problem:
            raise EngineError(problem)
    except EngineError as e:
        raise click.UsageError(str(e)) from None
    kwargs["dp_size"] = ranks
    init = f"tcp://127.0.0.1:{free_port()}"
    rank_args = [["--dp-attention-rank", str(r), "--dp-attention-size", str(ranks),
                  "--dp-attention-init", init] for r in range(ranks)]
    _serve_dp(ctx, kwargs, rank_args)


def _serve_dp(ctx: click.Context, kwargs: dict, rank_args: list[list[str]] | None = None) -> None:
    from engine.config import EngineConfig
    from engine.errors import EngineError
    from engine.router.launch import serve_dp
    from engine.router.policy import RouterOptions

    config, server = split_options(kwargs, ctx.command.plugin_dests, SERVER_FLAGS)
    router = {k: config.pop(k) for k in ROUTER_FLAGS}
    if router["router_policy"] in ("round_robin", "shortest_queue"):
        unused = [f"--{k.replace('_', '-')}" for k in ROUTER_FLAGS[2:] if given(ctx, k)]
        if unused:
            raise click.UsageError(f"{', '.join(unused)}: only cache_aware uses them, not "
                                   f"--router-policy {router['router_policy']}; drop them.")
    logging.basicConfig(level=server["log_level"].upper(),
                        format="[%(asctime)s %(levelname)s] %(message)s")
    if rank_args is not None:  # --enable-dp-attention: each replica is one of the tp ranks
        config["tp_size"] = 1
    try:  # refuse bad engine flags here, before N replicas start and each refuses them
        if rank_args is None:
            EngineConfig(**config).validate()
        options = RouterOptions(router["dp_size"], router["router_balance_abs_threshold"],
                                router["router_balance_rel_threshold"],
                                router["router_cache_threshold"]).validate()
    except (EngineError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    try:
        serve_dp(replica_args(ctx, tp_size=1 if rank_args else None), options,
                 router["router_policy"], server["host"], server["port"], server["api_key"],
                 server["shutdown_grace_period"], server["log_level"],
                 server["max_request_bytes"], config, rank_args)
    except RuntimeError as e:  # a replica that did not start
        raise click.ClickException(str(e)) from None
