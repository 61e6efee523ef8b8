"""Until `pip install -e plugins/advisor` (requirements-dev.txt), the tests import the package
from its folder and register it themselves (the `advisor` fixture)."""

import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import engine_advisor  # noqa: F401
except ImportError:
    sys.path.insert(0, HERE)
