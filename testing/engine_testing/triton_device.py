"""Where the Triton kernels' tests run: on the GPU when torch sees one, else on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, float32 and float16 only there). Call
``triton_device()`` before importing a module that decorates kernels (the interpreter is read
at decoration); a test module without triton is skipped."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def triton_device() -> str:
    """"cuda" or "cpu" (the interpreter switched on); skips the calling module without
    triton."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs the triton package (pip install triton)", allow_module_level=True)
    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"
