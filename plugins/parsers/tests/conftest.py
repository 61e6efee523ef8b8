"""engine_parsers is importable from its folder (its tests need no install), and so is the
tests' own helper (parser_splits)."""

import os
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(TESTS_DIR), TESTS_DIR):
    if path not in sys.path:
        sys.path.insert(0, path)
