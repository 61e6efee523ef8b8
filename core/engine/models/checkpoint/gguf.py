"""A GGUF file (or a directory holding one) as a checkpoint. It is converted once: its config,
its tokenizer (transformers' GGUF converter) and its weights dequantized to the compute dtype are
cached under ``<cache>/gguf/v2/<name>-<sha256>/`` (``engine.paths.cache_root``; ``v2`` versions
the conversion), keyed by the file's hash, so later starts read safetensors and a tokenizer.json
instead of dequantizing and converting again; its quantized blocks (for a linear kernel that
runs them as they are) beside them. Where the cache cannot be written the GGUF is read directly,
every start."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from engine.errors import EngineError
from engine.models.checkpoint.base import Checkpoint, Keep, dtype_name
from engine.models.checkpoint.gguf_cache import ShardWriter, file_sha256, write_atomic
from engine.models.checkpoint.hf import iter_safetensors, load_tokenizer_dir
from engine.paths import cache_root

logger = logging.getLogger("engine")
GGUF_CACHE_VERSION = "v2"  # bump when the conversion changes, so stale caches are not read
# (v2: the blocks cache holds MoE experts' blocks too)


class GGUFCheckpoint(Checkpoint):
    format = "gguf"
    mismatch_hint = "does the GGUF metadata match its tensors?"

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.config_source = f"the metadata of {path}"
        self._file = None
        self._blocks: dict | None = None  # blocks(): read once (cache or file)
        root = cache_root() / "gguf" / GGUF_CACHE_VERSION
        stem = os.path.basename(path).removesuffix(".gguf")
        try:
            digest = file_sha256(path, root / "hashes.json")
        except OSError as e:
            raise EngineError(f"cannot read '{path}': {e.strerror}.") from None
        self.cache_dir = root / f"{stem}-{digest[:16]}"
        cached = self.cache_dir / "config.json"
        if cached.is_file():
            self.hf_config = json.loads(cached.read_text())
        else:
            from engine.models.gguf_config import hf_config

            self.hf_config = hf_config(self.file)
            self._try_cache("config", lambda: write_atomic(cached, json.dumps(
                self.hf_config, indent=2)))

    @property
    def file(self):
        """The opened GGUF (parsing its metadata takes seconds on a large vocabulary: only
        done when something is not cached)."""
        if self._file is None:
            from engine.models.gguf import GGUFFile

            self._file = GGUFFile(self.path)
        return self._file

    def _try_cache(self, what: str, write) -> bool:
        try:
            write()
            return True
        except OSError as e:
            self._warn(what, e)
            return False

    def _warn(self, what: str, error: OSError) -> None:
        logger.warning(f"could not cache the GGUF's {what} in {self.cache_dir} ({error}); it "
                       f"will be converted again at the next start")

    def label(self, name: str) -> str:
        return self.file.label(name)

    def blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """``name``'s weight in its GGUF block format ("q4_1", ...) as raw bytes [rows, bytes
        per row], or None when the file stores it otherwise (see GGUFFile.blocks). All of
        them are cached beside the dequantized weights (``blocks.safetensors``, uint8, q/k
        rows unpermuted), so a cached start does not parse the GGUF (seconds)."""
        if self._blocks is None:
            self._blocks = self._load_blocks()
        return self._blocks.get(name)

    def block_formats(self) -> set[str]:
        """The formats of every tensor ``blocks`` gives ({"q4_1", "q8_0"} for the default
        model: Q4_1 linears, a Q8_0 embedding). Listed in the cache (``block_formats.json``),
        so that asking (a ``--quantization`` that then converts the model) neither parses the
        GGUF nor keeps its blocks in memory at a later start."""
        listed = self.cache_dir / "block_formats.json"
        if self._blocks is None and listed.is_file():
            with contextlib.suppress(OSError, ValueError):
                return set(json.loads(listed.read_text()))
        blocks = self._blocks if self._blocks is not None else self._load_blocks()
        formats = {fmt for fmt, _ in blocks.values()}
        if not listed.is_file():
            self._try_cache("block formats",
                            lambda: write_atomic(listed, json.dumps(sorted(formats))))
        return formats

    def _load_blocks(self) -> dict[str, tuple[str, torch.Tensor]]:
        path = self.cache_dir / "blocks.safetensors"
        if path.is_file():
            try:
                with safe_open(str(path), framework="pt") as f:
                    formats = f.metadata() or {}
                    return {n: (formats[n], f.get_tensor(n)) for n in f.keys()}
            except Exception as e:  # noqa: BLE001 - a damaged cache is rebuilt, not trusted
                logger.warning(f"the GGUF block cache {path} could not be read ({e}); "
                               f"reading the blocks from the GGUF again")
        found = {n: self.file.blocks(n, self.hf_config) for n in self.file.block_names()}
        found = {n: b for n, b in found.items() if b is not None}

        def write():
            from safetensors.torch import save_file

            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".safetensors", dir=path.parent)
            os.close(fd)
            try:
                save_file({n: raw for n, (_, raw) in found.items()}, tmp,
                          metadata={n: fmt for n, (fmt, _) in found.items()})
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        if found:
            self._try_cache("blocks", write)
        return found

    # weights ---------------------------------------------------------------------------------
    def _weights_dir(self, dtype: torch.dtype) -> Path:
        return self.cache_dir / f"weights-{dtype_name(dtype)}"

    def tensors(self, dtype: torch.dtype, keep: Keep | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        done = self._weights_dir(dtype) / "files.json"
        files = [str(done.parent / f) for f in json.loads(done.read_text())] \
            if done.is_file() else []
        if files and not all(os.path.isfile(f) for f in files):
            logger.warning(f"the GGUF cache {done.parent} lost some of its files; converting "
                           f"again")
            shutil.rmtree(done.parent, ignore_errors=True)
            files = []
        if files:
            self.notes.append(f"GGUF {self.path}: weights ({dtype_name(dtype)}) and config "
                              f"read from the cache {self.cache_dir}")
            return iter_safetensors(files, keep)
        return self._convert(dtype) if keep is None else self._convert_part(dtype, keep)

    def _convert(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Dequantize from the GGUF, writing the converted tensors into the cache as they go."""
        start = time.perf_counter()
        final = self._weights_dir(dtype)
        try:
            writer = ShardWriter(final)
        except OSError as e:
            writer = None
            self._warn("weights", e)
        try:
            for name, tensor in self.file.tensors(dtype, self.hf_config):
                if writer is not None and not self._try_cache("weights",
                                                              lambda: writer.add(name, tensor)):
                    writer.abort()
                    writer = None
                yield name, tensor
            seconds = time.perf_counter() - start
            if writer is not None and self._try_cache("weights", writer.finish):
                writer = None
                self.notes.append(f"GGUF {self.path}: dequantized to {dtype_name(dtype)} in "
                                  f"{seconds:.1f} s and cached in {self.cache_dir} (later starts "
                                  f"read the cache)")
            else:
                self.notes.append(f"GGUF {self.path}: dequantized to {dtype_name(dtype)} in "
                                  f"{seconds:.1f} s (not cached)")
        finally:
            if writer is not None:
                writer.abort()

    def _convert_part(self, dtype: torch.dtype, keep: Keep) -> Iterator[tuple[str, torch.Tensor]]:
        """Dequantize only the tensors ``keep`` accepts (a pipeline stage's), not cached: the
        cache holds whole models."""
        start, count = time.perf_counter(), 0
        for name, tensor in self.file.tensors(dtype, self.hf_config, keep):
            count += 1
            yield name, tensor
        self.notes.append(f"GGUF {self.path}: {count} of its tensors (this pipeline stage's) "
                          f"dequantized to {dtype_name(dtype)} in "
                          f"{time.perf_counter() - start:.1f} s (not cached: the cache holds "
                          f"whole models)")

    # tokenizer -------------------------------------------------------------------------------
    def load_tokenizer(self):
        cached = self.cache_dir / "tokenizer"
        if (cached / "tokenizer_config.json").is_file():
            return load_tokenizer_dir(str(cached))
        kind = self.file.tokenizer_type()  # a clear error when the file has no tokenizer
        from transformers import AutoTokenizer

        start = time.perf_counter()
        try:
            tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(self.path)),
                                                gguf_file=os.path.basename(self.path))
        except Exception as e:  # noqa: BLE001 - transformers' converter raises many kinds
            raise EngineError(
                f"could not build the tokenizer of '{self.path}' (tokenizer.ggml.model "
                f"'{kind}') with transformers: {type(e).__name__}: {e}. Pass --tokenizer DIR "
                f"with the model's tokenizer files instead.") from None
        seconds = time.perf_counter() - start

        def save():
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=self.cache_dir, prefix=".tmp-tokenizer-"))
            tok.save_pretrained(str(tmp))
            if cached.exists():  # another process got there first
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, cached)

        where = f"cached in {cached}" if self._try_cache("tokenizer", save) else "not cached"
        self.notes.append(f"GGUF {self.path}: tokenizer ({kind}) converted by transformers in "
                          f"{seconds:.1f} s, {where}")
        return tok
