"""The core's CPU-graph library (graph.c: the executor and the core's nodes), built once per
machine with the system C compiler (``engine.native.build_library``, ``-march=native``, keyed
by the CPU's flags and graph.h) and loaded with ctypes; and :class:`GraphNode`, what every
node is on the Python side (the core's and plugins')."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch  # loaded first, so the library's OpenMP dependency resolves to torch's own runtime

from engine.native import BuildError, build_library, cpu_flags

HERE = Path(__file__).parent
SOURCE = HERE / "graph.c"
HEADER = HERE / "graph.h"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
         "-ffp-contract=off"]
ABI = 2  # graph.h's EK_GRAPH_ABI


def include_dir() -> str:
    """The folder holding graph.h, for a plugin's C build (``-I``)."""
    return str(HERE)


MATH = HERE / "ek_math.h"  # the scalar exp graph.c and layers/cpu_fused.c share


def header_key() -> str:
    """What a library that includes graph.h keys its build on (its text)."""
    return HEADER.read_text()


def math_key() -> str:
    """What a library that includes ek_math.h keys its build on (its text)."""
    return MATH.read_text()


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    """The loaded library; raises BuildError with the reason."""
    target = build_library(SOURCE, FLAGS, "the CPU graph executor",
                           key_extra=header_key() + math_key() + cpu_flags())
    lib = ctypes.CDLL(str(target))
    P, I64, INT, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    sigs = {
        "ek_graph_abi": ([], INT),
        "ek_graph_new": ([], P),
        "ek_graph_free": ([P], None),
        "ek_graph_add": ([P, P, P], INT),
        "ek_graph_size": ([P], INT),
        "ek_graph_profile": ([P, P], None),
        "ek_graph_run": ([P, INT, I64, P, P, P, P, P, P, I64], None),
        "ek_args_free": ([P], None),
        "ek_embed_args": ([P, I64, P, I64], P),
        "ek_rmsnorm_args": ([P, I64, P, I64, P, I64, F, P, I64], P),
        "ek_rope_args": ([P, I64, I64, I64, P, I64, P, P, I64, F], P),
        "ek_silu_mul_args": ([P, I64, I64, P, I64], P),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    if lib.ek_graph_abi() != ABI:
        raise BuildError(f"graph.h says ABI {lib.ek_graph_abi()}, native.py {ABI}")
    return lib


def address(lib: ctypes.CDLL, name: str) -> int:
    """The address of a library's exported function (a node function for GraphNode.fn)."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class CArgs:
    """A C argument block (a pointer a library allocated), freed with ``free`` (the library's
    own free function) when the last reference goes."""

    def __init__(self, ptr: int | None, free, what: str = "node arguments"):
        if not ptr:
            raise MemoryError(f"out of memory for {what}")
        self.ptr, self._free = ptr, free

    def __del__(self):
        if self.ptr:
            self._free(self.ptr)
            self.ptr = 0


@dataclass(eq=False)
class GraphNode:
    """One node of a CPU graph: ``fn``, the address of a C function with graph.h's
    ``ek_node_fn`` signature, and ``args``, the address of its argument block. ``keep``
    holds whatever must outlive the graph for ``args`` to stay valid (the CArgs that owns
    the block, the tensors it points into); ``name`` says what it computes (logs, tests)."""

    fn: int
    args: int
    name: str = ""
    keep: list = field(default_factory=list)


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
