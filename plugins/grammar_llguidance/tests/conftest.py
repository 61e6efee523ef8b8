"""The plugin's package is importable from its folder (the tests need no install), and the two
tokenizers the tests drive matchers with: the default model's and a tiny trained one."""

from __future__ import annotations

import os
import sys

import pytest

PLUGIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PLUGIN_DIR not in sys.path:
    sys.path.insert(0, PLUGIN_DIR)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from engine.models.checkpoint import open_checkpoint
    from engine.models.default import default_model_path

    return open_checkpoint(default_model_path()).load_tokenizer()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from engine.models.checkpoint import load_tokenizer_dir

    return load_tokenizer_dir(tiny_tokenizer_dir)
