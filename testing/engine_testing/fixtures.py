"""The kit's pytest fixtures, a pytest plugin that a test suite turns on with
``pytest_plugins = ["engine_testing.fixtures"]`` in its root conftest.py (as pytest's own
``pytester``): tiny random-init checkpoints and tokenizers built once per session, the default
model's tokenizer, model runners, servers in this process or as subprocesses, and the engine's
cache directory kept apart from the user's."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def registries():
    from engine.plugins import get_registries

    return get_registries()


@pytest.fixture(scope="session")
def cpu_device():
    from engine.device import detect_device

    return detect_device("cpu")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    from engine_testing.checkpoints import train_tokenizer

    return train_tokenizer(str(tmp_path_factory.mktemp("tiny-tokenizer")))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    """The tiny trained tokenizer, loaded as the engine loads one (a transformers tokenizer)."""
    from engine.models.checkpoint import load_tokenizer_dir

    return load_tokenizer_dir(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The default model's (SmolLM2's) tokenizer."""
    from engine.models.checkpoint import open_checkpoint
    from engine.models.default import default_model_path

    return open_checkpoint(default_model_path()).load_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(case="llama", **config_overrides) -> path``: ``case`` is a name from
    ``engine_testing.checkpoints.TINY_CASES`` or an HF architecture; each distinct call is built
    once."""
    from engine_testing.checkpoints import TINY_CASES, make_tiny_model

    built: dict = {}

    def make(case: str = "llama", **overrides) -> str:
        key = (case, repr(sorted(overrides.items())))
        if key not in built:
            arch, base = TINY_CASES.get(case, (case, {}))
            out = tmp_path_factory.mktemp(f"tiny-{case}")
            built[key] = make_tiny_model(str(out), arch, **{**base, **overrides})
        return built[key]

    return make


@pytest.fixture(scope="session", autouse=True)
def engine_cache_dir(tmp_path_factory):
    """The engine's cache (converted GGUFs, built kernels) in a session directory, so that tests
    neither read nor fill the user's ~/.cache/engine; servers started by tests inherit it."""
    import os

    path = str(tmp_path_factory.mktemp("engine-cache"))
    before = os.environ.get("ENGINE_CACHE_DIR")
    os.environ["ENGINE_CACHE_DIR"] = path
    yield path
    if before is None:
        os.environ.pop("ENGINE_CACHE_DIR", None)
    else:
        os.environ["ENGINE_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def tiny_gguf_factory(tiny_model_factory, tmp_path_factory):
    """``make(case="llama", qtype="F32", **config_overrides) -> path``: the tiny checkpoint of
    ``tiny_model_factory`` written as a GGUF file the way llama.cpp's converter writes one."""
    from engine_testing.gguf_writer import write_gguf

    built: dict = {}

    def make(case: str = "llama", qtype: str = "F32", **overrides) -> str:
        key = (case, qtype, repr(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"gguf-{case}-{qtype}") / f"tiny-{case}.{qtype}.gguf"
            built[key] = write_gguf(tiny_model_factory(case, **overrides), str(out), qtype)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(request, tiny_model_factory):
    """A tiny checkpoint directory; parametrize indirectly with a TINY_CASES name or an
    architecture (default: "llama")."""
    return tiny_model_factory(getattr(request, "param", "llama"))


@pytest.fixture(scope="session")
def make_runner(registries, cpu_device):
    """``make(path, quantization=None, kv="auto", dtype="float32", tokens=2048)``: a
    ModelRunner with its KV pool."""
    from engine.runner import ModelRunner

    def make(path, quantization=None, kv="auto", dtype="float32", tokens=2048):
        method = registries.quantization.get(quantization).obj if quantization else None
        runner = ModelRunner(path, registries=registries, device=cpu_device, dtype=dtype,
                             kv_dtype=registries.kv_dtypes.get(kv).obj, quant_method=method)
        runner.init_kv_pool(tokens)
        return runner

    return make


@pytest.fixture
def single_torch_thread():
    """Run a test on one torch thread. Tiny models gain nothing from more, and on a shared
    2-core machine OpenMP's barrier waits make 2 threads several times slower under load."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def in_process_server():
    """``serve(engine) -> InProcessServer`` serving ``engine`` in this process (started; every
    one stopped after the test)."""
    from engine_testing.servers import InProcessServer

    started = []

    def serve(engine):
        server = InProcessServer(engine).__enter__()
        started.append(server)
        return server

    yield serve
    for server in started:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def start_server(tiny_model_factory, tmp_path_factory):
    """``start(*flags, api_key=None, default_model=False, model=None) -> ServerProcess``
    (ready), serving the tiny llama (or, with ``default_model``, no --model: SmolLM2; or
    ``model``, a path) with a small KV pool; every server still running at the end of the
    session is stopped."""
    from engine.server.process import ServerProcess

    started = []

    def start(*flags: str, api_key: str | None = None, default_model: bool = False,
              model: str | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        model = [] if default_model else ["--model", model or tiny_model_factory("llama")]
        args = [*model, "--max-total-tokens", "4096", *flags]
        # one torch thread: tiny models gain nothing from more on a shared 2-core machine
        server = ServerProcess(args, log, api_key, env={"OMP_NUM_THREADS": "1"})
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()
