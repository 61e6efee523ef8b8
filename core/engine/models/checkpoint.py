"""A model on disk as the engine reads it: a Hugging Face directory (config.json, safetensors,
tokenizer files) or a GGUF file (or a directory holding one). Either way the loader sees an HF
config dict, tensors under HF names and a transformers tokenizer.

A GGUF is converted once: its config, its tokenizer (transformers' GGUF converter) and its
weights dequantized to the compute dtype are cached under
``<cache>/gguf/v1/<name>-<sha256>/`` (``engine.paths.cache_root``; ``v1`` versions the
conversion), keyed by the file's hash, so later starts read safetensors and a tokenizer.json
instead of dequantizing and converting again. Where the cache cannot be written the GGUF is
read directly, every start."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from engine.paths import cache_root
from engine.registry import EngineError

logger = logging.getLogger("engine")
INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 1 << 30  # cache shards: bounds the memory a write-through holds
GGUF_CACHE_VERSION = "v1"  # bump when the conversion changes, so stale caches are not read
Keep = Callable[[str], bool]  # which tensors (by HF name) a reader reads; the rest it skips


class Checkpoint:
    format = ""
    path = ""           # the directory or file read
    config_source = ""  # how errors name the config
    mismatch_hint = ""  # what a wrong tensor suggests
    hf_config: dict

    def __init__(self) -> None:
        self.notes: list[str] = []  # how it was read (cache used, conversion time): for the log

    def tensors(self, dtype: torch.dtype, keep: Keep | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every weight; ``keep``: only those whose name it accepts, the
        others never read (a pipeline stage's)."""
        raise NotImplementedError

    def label(self, name: str) -> str:
        return f"'{name}'"

    def blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """A weight kept in a quantized block format a linear kernel may run as it is (a
        GGUF's Q4_1, ...): (format, raw bytes [rows, bytes per row]); None: only ``tensors``."""
        return None

    def load_tokenizer(self):
        raise NotImplementedError


def open_checkpoint(path: str) -> Checkpoint:
    """A checkpoint for ``path``: an HF directory, a ``.gguf`` file, or a directory holding
    exactly one ``.gguf`` (and no config.json)."""
    if os.path.isfile(path):
        return GGUFCheckpoint(path)
    if not os.path.isdir(path):
        raise EngineError(f"Model path '{path}' does not exist (give a Hugging Face model "
                          f"directory or a .gguf file).")
    if os.path.isfile(os.path.join(path, "config.json")):
        return HFCheckpoint(path)
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return GGUFCheckpoint(os.path.join(path, ggufs[0]))
    if ggufs:
        raise EngineError(f"'{path}' holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); pass "
                          f"the one to serve as --model {os.path.join(path, ggufs[0])}.")
    raise EngineError(f"'{path}' has no config.json; point the model path at a Hugging Face "
                      f"model directory (config.json plus *.safetensors) or a .gguf file.")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- Hugging Face directories ---------------------------------------------------------------
def read_config_json(path: str) -> dict:
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise EngineError(f"{path} is not valid JSON: {exc}") from None


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
        if missing:
            raise EngineError(f"{index} lists shards that are not in the directory: "
                              f"{', '.join(missing)}.")
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        others = [f for f in os.listdir(model_dir) if f.endswith((".bin", ".pt", ".pth"))]
        hint = (f" It has {', '.join(others[:3])}: convert the weights to safetensors."
                if others else "")
        raise EngineError(f"'{model_dir}' has no *.safetensors weights.{hint}")
    return [os.path.join(model_dir, f) for f in files]


def iter_safetensors(files: list[str], keep: Keep | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


class HFCheckpoint(Checkpoint):
    format = "hf"
    mismatch_hint = "does config.json match the weights?"

    def __init__(self, model_dir: str):
        super().__init__()
        self.path = model_dir
        self.config_source = os.path.join(model_dir, "config.json")
        self.hf_config = read_config_json(self.config_source)

    def tensors(self, dtype: torch.dtype, keep: Keep | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        # copied into dtype by the loader
        return iter_safetensors(safetensors_files(self.path), keep)

    def load_tokenizer(self):
        return load_tokenizer_dir(self.path)


def load_tokenizer_dir(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise EngineError(f"could not load a tokenizer from '{path}': {e}") from None


# -- GGUF files -----------------------------------------------------------------------------
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
            _write_atomic(memo, json.dumps(known, indent=1))
    return digest


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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
            self.hf_config = self.file.hf_config()
            self._try_cache("config", lambda: _write_atomic(cached, json.dumps(
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
