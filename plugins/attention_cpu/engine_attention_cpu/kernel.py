"""Build the C attention kernels once per machine and load them with ctypes: decode rows
(decode_attention.c, also the CPU graph's node) and prompt chunks (prompt_attention.c).

Built by ``engine.native.build_library`` (the system C compiler, into ``<engine cache>/kernels``),
keyed also by the CPU's flags (``-march=native``), so a cache shared between machines never runs
code built for another CPU. No torch headers are needed: a build takes about a second.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch  # loaded first, so the kernel's OpenMP dependency resolves to torch's own runtime

from engine.cpu_graph import header_key, include_dir
from engine.native import BuildError as KernelUnavailable  # noqa: F401 - this plugin's name
from engine.native import build_library, cpu_flags

SOURCE = Path(__file__).with_name("decode_attention.c")
PROMPT_SOURCE = Path(__file__).with_name("prompt_attention.c")
SHARED = Path(__file__).with_name("kv_rows.h")  # what both sources include
# not -ffast-math: linked into a shared object it brings crtfastmath, whose constructor turns on
# flush-to-zero for the thread that loads the library (and threads it starts), changing torch's
# own float results there; and its finite-math assumption would break the -INFINITY the
# softmax starts from. The reassociation the reductions need, without either:
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
         "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    """The loaded kernel library; raises KernelUnavailable with the reason."""
    # -march=native: keyed by the CPU's flags too
    # graph.h (the CPU graph's node ABI) from the core
    target = build_library(SOURCE, [*FLAGS, "-I", include_dir()], "its kernel",
                           key_extra=cpu_flags() + header_key() + SHARED.read_text())
    lib = ctypes.CDLL(str(target))
    P, I64, F, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.decode_attention.argtypes = [P, P, P, P, P, INT, P, I64, P, P, I64, I64, I64, I64, I64,
                                     F, F, F, INT]
    lib.decode_attention.restype = INT
    lib.ek_attention_node_args.argtypes = [P, I64, P, P, I64, P, I64, P, P, INT, INT, I64, I64,
                                           I64, I64, F, F, F, P]
    lib.ek_attention_node_args.restype = P
    lib.ek_attention_node_free.argtypes, lib.ek_attention_node_free.restype = [P], None
    lib.ek_attention_partial_bytes.argtypes = [I64, I64]
    lib.ek_attention_partial_bytes.restype = ctypes.c_size_t
    return lib


@functools.lru_cache(maxsize=None)
def load_prompt() -> ctypes.CDLL:
    """The prompt-chunk kernel's library; raises KernelUnavailable with the reason."""
    target = build_library(PROMPT_SOURCE, FLAGS, "its prompt kernel",
                           key_extra=cpu_flags() + SHARED.read_text())
    lib = ctypes.CDLL(str(target))
    P, I64, F, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.prompt_attention.argtypes = [P, I64, P, I64, P, P, P, P, I64, P, P, INT, P, I64, I64,
                                     I64, I64, I64, F, F, F, INT]
    lib.prompt_attention.restype = INT
    return lib


def prompt_shape_ok(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether prompt_attention takes these heads (else the caller runs SDPA)."""
    return (head_dim % 16 == 0 and head_dim <= 128 and num_kv_heads > 0
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64)


def prompt_attention(q: torch.Tensor, out: torch.Tensor, q_start: torch.Tensor,
                     ext: torch.Tensor, prefix: torch.Tensor, rows: torch.Tensor,
                     k_pool: torch.Tensor, v_pool: torch.Tensor, req_to_token: torch.Tensor,
                     window: int | None, scale: float, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> None:
    """For each request b: its ``ext[b]`` new tokens, rows ``q_start[b]`` on of q and out, at
    positions ``prefix[b]`` on, attend causally to the keys of ``req_to_token[rows[b]]`` up
    to their own position (the last ``window`` with a window); their K/V already stored.

    q, out: float32 [T, H, D], heads contiguous (rows may be further apart: a view of qkv);
    q_start, ext, prefix, rows: int64 [B] contiguous; D a multiple of 16 up to 128
    (prompt_shape_ok)."""
    H, D = q.shape[1:]
    assert q.dtype == out.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == D
    assert out.stride(2) == 1 and out.stride(1) == D and k_pool.dtype == v_pool.dtype
    for t in (q_start, ext, prefix, rows):
        assert t.dtype == torch.int64 and t.is_contiguous()
    for t in (k_pool, v_pool, req_to_token):
        assert t.is_contiguous() and t.device.type == "cpu"
    status = load_prompt().prompt_attention(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), q_start.data_ptr(),
        ext.data_ptr(), prefix.data_ptr(), rows.data_ptr(), ext.numel(), k_pool.data_ptr(),
        v_pool.data_ptr(), DTYPES[k_pool.dtype], req_to_token.data_ptr(),
        req_to_token.stride(0), H, k_pool.shape[1], D, window or 0, scale, k_scale, v_scale,
        torch.get_num_threads())
    if status == 1:
        raise ValueError(f"prompt_attention cannot take H={H}, KVH={k_pool.shape[1]}, D={D}")
    if status:
        raise MemoryError("prompt_attention: out of memory for its per-thread buffers")


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
