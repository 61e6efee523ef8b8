"""Writing the GGUF conversion cache safely: a file's hash remembered by path, size and mtime,
files replaced atomically, dequantized weights written as safetensors shards into a temporary
directory moved into place once complete (another process converting the same file at the same
time loses nothing)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

SHARD_BYTES = 1 << 30  # cache shards: bounds the memory a write-through holds


def file_sha256(path: str, memo: Path | None = None) -> str:
    """sha256 of the file; remembered in ``memo`` (a JSON file) by path, size and mtime, so a
    large file is hashed once, not at every start."""
    st = os.stat(path)
    key, stamp = os.path.realpath(path), [st.st_size, st.st_mtime_ns]
    known: dict = {}
    if memo is not None:
        with contextlib.suppress(OSError, ValueError):
            known = json.loads(memo.read_text())
        if known.get(key, {}).get("stamp") == stamp:
            return known[key]["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    digest = h.hexdigest()
    if memo is not None:
        known[key] = {"stamp": stamp, "sha256": digest}
        with contextlib.suppress(OSError):
            write_atomic(memo, json.dumps(known, indent=1))
    return digest


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class ShardWriter:
    """Writes tensors into safetensors shards of at most SHARD_BYTES in a temporary directory;
    ``finish`` lists them in files.json and moves the directory into place atomically."""

    def __init__(self, final: Path):
        self.final = final
        final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-weights-"))
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[str] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self.pending:
            name = f"model-{len(self.files) + 1:05d}.safetensors"
            save_file(self.pending, str(self.tmp / name), metadata={"format": "pt"})
            self.files.append(name)
            self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self._flush()
        (self.tmp / "files.json").write_text(json.dumps(self.files))
        if self.final.exists():  # another process converted it meanwhile
            shutil.rmtree(self.tmp)
        else:
            os.replace(self.tmp, self.final)

    def abort(self) -> None:
        self.pending = {}
        shutil.rmtree(self.tmp, ignore_errors=True)
