"""engine_grammar_xgrammar is importable from its folder (its tests need no install); the
tokenizers its tests use are engine_testing.fixtures' (the repository's root conftest.py
turns them on)."""

import os
import sys

PLUGIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PLUGIN_DIR not in sys.path:
    sys.path.insert(0, PLUGIN_DIR)
