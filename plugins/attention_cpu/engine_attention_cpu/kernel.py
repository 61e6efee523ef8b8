"""Build the C decode-attention kernel once per machine and load it with ctypes.

The source is compiled with the system C compiler (``$CC``, else ``cc`` or ``gcc``) into
``$ENGINE_CACHE_DIR`` (default ``~/.cache/engine``), keyed by a hash of the source, the flags, the
compiler's version and the CPU's flags, so a cache shared between machines never runs code built
for another CPU. No torch headers are needed: a build takes about a second.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # loaded first, so the kernel's OpenMP dependency resolves to torch's own runtime

from engine.paths import cache_root

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class KernelUnavailable(Exception):
    """Why the kernel cannot be built here, in words for the user."""


def compiler() -> str | None:
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc")):
        path = shutil.which(name)
        if path:
            return path
    return None


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    """The loaded kernel library; raises KernelUnavailable with the reason."""
    cc = compiler()
    if cc is None:
        raise KernelUnavailable("needs a C compiler to build its kernel (gcc or cc on PATH, or $CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join(
        [SOURCE.read_text(), *FLAGS, version, _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"decode_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        result = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            first = (result.stderr.strip().splitlines() or ["no output"])[0]
            raise KernelUnavailable(f"its kernel failed to build with {cc}: {first}")
        os.replace(tmp, target)  # atomic: a concurrent build never loads a half-written file
    lib = ctypes.CDLL(str(target))
    P, I64, F, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.decode_attention.argtypes = [P, P, P, P, P, INT, P, I64, P, P, I64, I64, I64, I64, I64,
                                     F, F, F, INT]
    lib.decode_attention.restype = INT
    return lib


def decode_attention(q: torch.Tensor, out: torch.Tensor, q_tokens: torch.Tensor,
                     k_pool: torch.Tensor, v_pool: torch.Tensor, req_to_token: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, window: int | None,
                     scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """For each decode row b: ``out[q_tokens[b]] = attention(q[q_tokens[b]], the first
    seq_lens[b] keys of req_to_token[rows[b]])``, the last ``window`` of them with a window.

    q, out: float32 [T, H, D] contiguous; pools [slots, KVH, D] in a type of ``DTYPES``;
    q_tokens, rows, seq_lens: int64 [B] contiguous; req_to_token: int32 [R, max_context].
    """
    B = q_tokens.numel()
    T, H, D = q.shape
    KVH = k_pool.shape[1]
    for t in (q, out, k_pool, v_pool, req_to_token, q_tokens, rows, seq_lens):
        assert t.is_contiguous() and t.device.type == "cpu"
    assert q.dtype == out.dtype == torch.float32 and k_pool.dtype == v_pool.dtype
    assert q_tokens.dtype == rows.dtype == seq_lens.dtype == torch.int64
    assert req_to_token.dtype == torch.int32
    status = load().decode_attention(
        q.data_ptr(), out.data_ptr(), q_tokens.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
        DTYPES[k_pool.dtype], req_to_token.data_ptr(), req_to_token.stride(0), rows.data_ptr(),
        seq_lens.data_ptr(), B, H, KVH, D, window or 0, scale, k_scale, v_scale,
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"decode_attention cannot take H={H}, KVH={KVH}, D={D} "
                         "(H must be a multiple of KVH and H * D at most 65536)")
