"""The ``file`` HiCache storage backend (``--hicache-storage-backend file``), SGLang's
HiCacheFile: one file per page under the storage directory (--hicache-storage-dir, else
$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else /tmp/hicache), shareable by servers on one
machine or a shared file system, and kept across restarts."""

from __future__ import annotations

import os
import tempfile

from engine.hookspecs import hookimpl
from engine.interfaces import HiCacheStorage, HiCacheStorageContext


class FileStorage(HiCacheStorage):
    def __init__(self, ctx: HiCacheStorageContext):
        self.directory = ctx.directory
        os.makedirs(self.directory, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.kvpage")

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def set(self, key: str, value: bytes) -> None:
        # written beside, then renamed: a reader (another server too) sees all or nothing
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, self._path(key))
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def describe(self) -> str:
        return f"file ({self.directory})"


@hookimpl
def register_hicache_storage(register):
    register("file", FileStorage, description="one file per page in a directory (SGLang's "
                                              "HiCacheFile; $SGLANG_HICACHE_FILE_BACKEND_"
                                              "STORAGE_DIR)")
