"""The plugin's tests share helpers (recording.py); pytest runs with --import-mode=importlib,
which puts no test folder on sys.path: this one is."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
