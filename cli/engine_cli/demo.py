"""Where the bundled demo model lives (shipped inside engine-core)."""

import os

import engine

DEMO_MODEL = os.path.join(os.path.dirname(engine.__file__), "demo_model")
