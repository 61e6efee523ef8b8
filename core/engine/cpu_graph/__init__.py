"""CPU graphs: a decode forward recorded once as C nodes and replayed each step in one call
(replay.py), what a model records it with (builder.py), the executor and the core's nodes
(graph.c, graph.h: the C side a plugin's nodes implement) and how it is built (native.py).

A plugin offers nodes through ``LinearKernel.graph_nodes`` and
``AttentionBackend.cpu_graph_nodes``: C functions with graph.h's signature (compile with
``-I`` :func:`include_dir`) handed over as :class:`GraphNode` (docs/plugins.md)."""

from engine.cpu_graph.native import CArgs, GraphNode, include_dir, header_key  # noqa: F401
from engine.interfaces import GraphUnsupported  # noqa: F401
