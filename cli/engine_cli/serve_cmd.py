"""`engine serve`: every engine knob as an SGLang-spelled flag, plus the plugins' own options."""

from __future__ import annotations

import logging

import click

from engine_cli.options import EngineCommand, engine_options, split_options

SERVER_FLAGS = ("host", "port", "api_key", "served_model_name", "log_level",
                "max_request_bytes", "shutdown_grace_period")


@click.command("serve", cls=EngineCommand, context_settings={"show_default": True})
@engine_options
@click.option("--max-queued-requests", type=int,
              help="Answer 503 when this many requests already wait.  [default: no limit]")
@click.option("--host", default="127.0.0.1")
@click.option("--port", default=30000, type=int)
@click.option("--api-key", help="Require 'Authorization: Bearer KEY' on every route but "
                                "/health.")
@click.option("--served-model-name", help="The model name clients use.  [default: --model; "
                                          "SmolLM2-135M-Instruct for the default model]")
@click.option("--log-level", default="info",
              type=click.Choice(["debug", "info", "warning", "error", "critical"]))
@click.option("--max-request-bytes", default=32 << 20, type=click.IntRange(min=1),
              help="Larger request bodies get a 413.")
@click.option("--shutdown-grace-period", default=30.0, type=click.FloatRange(min=0),
              help="Seconds in-flight requests get to finish after SIGTERM/SIGINT.")
def serve_command(**kwargs):
    """Serve a model over HTTP (OpenAI-compatible and SGLang-style routes)."""
    from engine.engine import Engine
    from engine.registry import EngineError
    from engine.server.launch import serve
    from engine.server.serving import ServerSettings

    config, server = split_options(kwargs, click.get_current_context().command.plugin_dests,
                                   SERVER_FLAGS)
    log_level = server.pop("log_level")
    logging.basicConfig(level=log_level.upper(), format="[%(asctime)s %(levelname)s] %(message)s")
    try:
        engine = Engine(**config)
    except EngineError as e:
        raise click.UsageError(str(e)) from None
    server["served_model_name"] = server["served_model_name"] or engine.model_name
    serve(engine, ServerSettings(model_path=engine.checkpoint.path, **server), log_level)
