"""GraphBuilder: what a model uses to record its decode forward as CPU-graph nodes.

The model (``cpu_graph(builder)``, e.g. LlamaForCausalLM's) asks for float32 buffers of
``max_rows`` rows and adds nodes that read and write them: the core's own (embedding, RMSNorm
with the residual add, rotary embedding, SiLU-and-multiply, from graph.c), each linear
layer's kernel's (``LinearKernel.graph_nodes``) and the attention backend's
(``AttentionBackend.cpu_graph_nodes``). Anything that has no node raises GraphUnsupported,
which says why; the graph is then not used."""

from __future__ import annotations

import torch

from engine.cpu_graph import native
from engine.cpu_graph.native import CArgs, GraphNode, ptr
from engine.interfaces import GraphUnsupported, LinearKernel
from engine.layers.linear import PrepackedWeight


def _row_stride(t: torch.Tensor) -> int:
    if t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1:
        raise GraphUnsupported(f"a graph buffer must be a float32 [rows, cols] view with "
                               f"unit column stride, got {t.dtype} {tuple(t.shape)}")
    return t.stride(0)


class GraphBuilder:
    def __init__(self, max_rows: int, backend=None):
        self.max_rows = max_rows
        self.backend = backend
        self.lib = native.load()
        self.nodes: list[GraphNode] = []
        self.buffers: list[torch.Tensor] = []
        self.keep: list = []  # tensors the nodes point into (weights made contiguous, ...)

    # -- buffers and nodes --------------------------------------------------------------------
    def buffer(self, cols: int) -> torch.Tensor:
        """A float32 [max_rows, cols] buffer the nodes read and write (zeroed once)."""
        buf = torch.zeros(self.max_rows, cols, dtype=torch.float32)
        self.buffers.append(buf)
        return buf

    def add(self, nodes: list[GraphNode]) -> None:
        for node in nodes:
            if not isinstance(node, GraphNode) or not node.fn or not node.args:
                raise GraphUnsupported(f"not a graph node: {node!r}")
            self.nodes.append(node)

    def _core(self, fn: str, args: int, name: str, *keep) -> None:
        self.add([GraphNode(native.address(self.lib, fn), args, name,
                            [CArgs(args, self.lib.ek_args_free, name), *keep])])

    def _param(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """A float32 contiguous copy of a parameter where it is not one already (kept)."""
        if t.device.type != "cpu":
            raise GraphUnsupported(f"{what} is on {t.device}: CPU graphs run on the CPU")
        if t.dtype != torch.float32:
            raise GraphUnsupported(f"{what} is {t.dtype}: CPU graphs run float32 "
                                   f"activations, norms and embeddings")
        t = t.detach().contiguous()
        self.keep.append(t)
        return t

    # -- the core's nodes ---------------------------------------------------------------------
    def embed(self, table: torch.Tensor, out: torch.Tensor) -> None:
        """out[r] = table[input_ids[r]]."""
        table = self._param(table, "the embedding")
        if table.dim() != 2 or table.shape[1] != out.shape[1]:
            raise GraphUnsupported(f"embedding {tuple(table.shape)} vs buffer "
                                   f"{tuple(out.shape)}")
        args = self.lib.ek_embed_args(ptr(table), table.shape[1], ptr(out), _row_stride(out))
        self._core("ek_node_embed", args, "embedding", table)

    def rmsnorm(self, res: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                add: torch.Tensor | None = None) -> None:
        """res += add (when given); out = weight * res / rms(res), per row."""
        weight = self._param(weight, "an RMSNorm weight")
        dim = weight.numel()
        args = self.lib.ek_rmsnorm_args(
            ptr(res), _row_stride(res), ptr(add), 0 if add is None else _row_stride(add),
            ptr(weight), dim, eps, ptr(out), _row_stride(out))
        self._core("ek_node_rmsnorm", args, "rmsnorm", weight)

    def rope(self, x: torch.Tensor, heads: int, head_dim: int, cos_sin: torch.Tensor,
             q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
             q_heads: int = 0, eps: float = 0.0) -> None:
        """Rotate ``heads`` heads of ``head_dim`` at the start of each row of x in place, by
        the row's position (``cos_sin`` [2, max_positions, head_dim / 2] float32: cos, sin);
        with ``q_norm`` / ``k_norm``, each of the first ``q_heads`` / the other heads first
        goes through that per-head RMSNorm."""
        cos_sin = self._param(cos_sin, "the rotary cos/sin cache")
        if cos_sin.dim() != 3 or cos_sin.shape[0] != 2 or cos_sin.shape[2] * 2 != head_dim:
            raise GraphUnsupported(f"rotary cache {tuple(cos_sin.shape)} for head_dim "
                                   f"{head_dim}: the graph rotates whole heads")
        qn = None if q_norm is None else self._param(q_norm, "q_norm")
        kn = None if k_norm is None else self._param(k_norm, "k_norm")
        args = self.lib.ek_rope_args(ptr(x), _row_stride(x), heads, head_dim, ptr(cos_sin),
                                     cos_sin.shape[1], ptr(qn), ptr(kn), q_heads, eps)
        self._core("ek_node_rope", args, "rope", cos_sin, qn, kn)

    def silu_mul(self, gate_up: torch.Tensor, inter: int, out: torch.Tensor) -> None:
        """out = silu(gate_up[:, :inter]) * gate_up[:, inter:2 * inter]."""
        args = self.lib.ek_silu_mul_args(ptr(gate_up), _row_stride(gate_up), inter, ptr(out),
                                         _row_stride(out))
        self._core("ek_node_silu_mul", args, "silu_mul")

    # -- the plugins' nodes -------------------------------------------------------------------
    def linear(self, module, x: torch.Tensor, y: torch.Tensor, what: str) -> None:
        """y = x @ W.T + bias through the kernel ``module`` (a packed linear layer) runs."""
        kernel = getattr(module, "kernel", None) if isinstance(module, PrepackedWeight) else None
        if not isinstance(kernel, LinearKernel):
            kind = {"onednn": "oneDNN on float32 weights", "fp16": "fbgemm's fp16 GEMM",
                    "": "F.linear"}.get(getattr(module, "packed_kind", None),
                                        type(module).__name__)
            raise GraphUnsupported(
                f"{what} runs {kind}, which has no CPU graph node; a linear kernel "
                f"plugin's packed weights have (engine-cpu-kernels: --dtype float16, or a "
                f"GGUF's Q4_0/Q4_1/Q8_0 blocks)")
        bias = getattr(module, "bias", None)
        if bias is not None:
            bias = self._param(bias, f"{what}'s bias")
        _row_stride(x), _row_stride(y)
        self.add(kernel.graph_nodes(module.packed_weight, bias, x, y, self.max_rows))

    def attention(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor) -> None:
        for t in (q, k, v, out):
            _row_stride(t)
        self.add(self.backend.cpu_graph_nodes(layer_id, q, k, v, out, self.max_rows))
