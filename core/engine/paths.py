"""Where the engine keeps files of its own: ``$ENGINE_CACHE_DIR``, else
``$XDG_CACHE_HOME/engine``, else ``~/.cache/engine``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("ENGINE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "engine")
    return Path(root)
