"""Benchmarks as a library (`engine bench` is a thin CLI over it; `engine tune` measures
configurations with it): ``run_bench(target, workload) -> BenchResult``.

``target`` picks where the workload runs:
- an ``Engine``, or a dict of Engine keyword arguments (the engine flags): offline, in this
  process;
- a URL (``http://host:port``): a running server, over HTTP;
- a list of ``engine serve`` flags: a server started for the run (``ServerProcess``) and stopped
  after it.
"""

from __future__ import annotations

import asyncio
import tempfile

from engine.bench.offline import run_offline
from engine.bench.result import BenchResult, RequestResult, Sample, format_table
from engine.bench.serve import run_serve, served_model
from engine.bench.workloads import BenchRequest, Workload, load_tokenizer
from engine.errors import EngineError
from engine.server.process import ServerProcess

__all__ = ["BenchRequest", "BenchResult", "RequestResult", "Sample", "Workload", "format_table",
           "run_bench"]


def run_bench(target, workload: Workload, *, max_concurrency: int | None = None,
              progress: bool = False, backend: str = "sglang", tokenizer: str | None = None,
              model: str | None = None, timeout: float = 600.0, server_log: str | None = None,
              ready_timeout: float = 600.0) -> BenchResult:
    """Run ``workload`` against ``target`` (see the module docstring); ``progress``: a tqdm bar
    on stderr. For a server: ``backend`` (sglang: /generate, openai: /v1/completions);
    ``tokenizer``: where the prompts' tokenizer comes from [default: the model the server
    names in /v1/models]; ``model``: the model name sent [default: the first of /v1/models];
    ``timeout``: per request, seconds; ``server_log``: a started server's log file [default: a
    temporary file]; ``ready_timeout``: seconds it gets to start."""
    workload.validate()
    if max_concurrency is not None and max_concurrency < 1:
        raise EngineError(f"--max-concurrency {max_concurrency}: give 1 or more.")
    client = dict(backend=backend, tokenizer=tokenizer, model=model, timeout=timeout)
    if isinstance(target, str):
        if not target.startswith(("http://", "https://")):
            raise EngineError(f"--base-url {target!r}: give http://host:port.")
        return _run_url(target, workload, max_concurrency, progress, **client)
    if isinstance(target, (list, tuple)):
        return _run_started(list(target), workload, max_concurrency, progress, client,
                            server_log, ready_timeout)
    if isinstance(target, dict):
        from engine.engine import Engine

        engine = Engine(**target)
        try:
            return _run_engine(engine, workload, max_concurrency, progress)
        finally:
            engine.close()
    if hasattr(target, "scheduler") and hasattr(target, "add_request"):
        return _run_engine(target, workload, max_concurrency, progress)
    raise EngineError(f"run_bench: target {type(target).__name__}: give an Engine, a dict of "
                      f"engine flags, a server URL or a list of `engine serve` flags.")


def _bar(progress: bool, n: int):
    if not progress:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=n, file=sys.stderr, unit="req", desc="requests")


def _run_engine(engine, workload, max_concurrency, progress) -> BenchResult:
    requests = workload.build(engine.tokenizer)
    bar = _bar(progress, len(requests))
    try:
        return run_offline(engine, requests, workload, max_concurrency=max_concurrency,
                           progress=bar)
    finally:
        if bar is not None:
            bar.close()


def _run_url(url, workload, max_concurrency, progress, *, backend, tokenizer, model,
             timeout) -> BenchResult:
    url = url.rstrip("/")
    card = asyncio.run(served_model(url))
    source = tokenizer or card.get("root")
    try:
        tok = load_tokenizer(source)
    except (EngineError, OSError, ValueError) as e:
        raise EngineError(f"cannot load the prompts' tokenizer from {source!r} ({e}); give "
                          f"--tokenizer (a model directory or GGUF with the server's "
                          f"tokenizer).") from None
    requests = workload.build(tok)
    bar = _bar(progress, len(requests))
    try:
        return asyncio.run(run_serve(url, requests, workload, backend=backend,
                                     model=model or card["id"], max_concurrency=max_concurrency,
                                     progress=bar, timeout=timeout))
    finally:
        if bar is not None:
            bar.close()


def _run_started(flags, workload, max_concurrency, progress, client, server_log,
                 ready_timeout) -> BenchResult:
    log = server_log or tempfile.NamedTemporaryFile(prefix="engine-bench-", suffix=".log",
                                                    delete=False).name
    server = ServerProcess(flags, log)
    try:
        try:
            server.wait_ready(timeout=ready_timeout)
        except RuntimeError as e:
            raise EngineError(f"engine serve {' '.join(flags)} did not start: {e}") from None
        return _run_url(server.url, workload, max_concurrency, progress, **client)
    finally:
        server.stop(timeout=60)
