"""Build a plugin's C source into a shared library once per machine, for ctypes (the C kernel
plugins: engine-attention-cpu, engine-cpu-kernels).

The source is compiled with the system C compiler (``$CC``, else ``cc`` or ``gcc``) into
``<engine cache>/kernels`` (``engine.paths.cache_root``), under a name keyed by a hash of the
source, the flags, the compiler's version and anything else the caller names (a ``-march=native``
build names the CPU's flags, so a cache shared between machines never runs code built for
another CPU). A concurrent build never loads a half-written file (written aside, then renamed).
Load torch before the library: its OpenMP dependency then resolves to torch's own runtime.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine.paths import cache_root


class BuildError(Exception):
    """Why the library cannot be built here, in words for the user."""


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc`` or ``gcc`` on PATH; None without one."""
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc")):
        path = shutil.which(name)
        if path:
            return path
    return None


def cache_dir() -> Path:
    return cache_root() / "kernels"


def cpu_flags() -> str:
    """The CPU's flags line of /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build_library(source: Path, flags: list[str], what: str, key_extra: str = "") -> Path:
    """The shared library built from ``source`` with ``flags`` (built now unless cached);
    BuildError naming ``what`` ("its kernel", ...) when there is no compiler or it fails."""
    cc = compiler()
    if cc is None:
        raise BuildError(f"needs a C compiler to build {what} (gcc or cc on PATH, or $CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), *flags, version, key_extra]).encode()
                         ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    result = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True,
                            text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        first = (result.stderr.strip().splitlines() or ["no output"])[0]
        raise BuildError(f"{what} failed to build with {cc}: {first}")
    os.replace(tmp, target)
    return target
