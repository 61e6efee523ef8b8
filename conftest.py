"""The root conftest of tests/ and plugins/*/tests/ (so both see it): the test kit's fixtures
(engine_testing.fixtures: tiny random-init checkpoints built once per session, runners,
servers), the tests' example plugin on sys.path, and Triton's interpreter without a GPU."""

from __future__ import annotations

import os
import sys

# The tests' third-party plugin (tests/fixtures/example_plugin: policy 'lifo', `engine
# example-hello`) is found through its dist-info on sys.path, here and in the servers the tests
# start; it is never installed, so `make install` users do not get it.
EXAMPLE_PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "fixtures",
                              "example_plugin")
if EXAMPLE_PLUGIN not in sys.path:
    sys.path.insert(0, EXAMPLE_PLUGIN)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (EXAMPLE_PLUGIN, os.environ.get("PYTHONPATH")) if p)

# Without a GPU, Triton kernels (the triton attention backend's) run under Triton's interpreter.
# Its jit reads this when a kernel (or triton.language's own helpers) is defined, so it is set
# before anything imports triton (torch.compile's inductor does).
if os.environ.get("TRITON_INTERPRET") is None and not os.path.exists("/dev/nvidiactl"):
    os.environ["TRITON_INTERPRET"] = "1"

pytest_plugins = ["engine_testing.fixtures"]
