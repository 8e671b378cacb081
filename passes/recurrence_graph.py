"""Small fx helpers shared by the recurrence passes (copying graphs, shape metadata)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from gradshard.ir import graph_module
from gradshard.fake import fake_run
from gradshard.pipeline import ancestors, copy_graph

__all__ = ["copy_graph_module", "emit_node", "fake_run", "live_nodes", "live_users", "time_from_dim1", "time_to_dim1"]

aten = torch.ops.aten


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copy of ``gm``'s graph (same node names and meta)."""
    new = graph_module(gm, copy_graph(gm), gm.__class__.__name__)
    for k, v in getattr(gm, "meta", {}).items():
        new.meta[k] = v
    return new


def live_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes the output depends on (make_fx keeps dead ``detach``/views; they do not count as uses)."""
    return ancestors(gm.graph.find_nodes(op="output"))


def live_users(node: fx.Node, live: set[fx.Node]) -> list[fx.Node]:
    return [u for u in node.users if u in live]


def emit_node(graph: fx.Graph, target: Any, args: tuple, trace: Any = None) -> fx.Node:
    """Insert ``target(*args)`` at the graph's insertion point, with ``meta['val']`` and the stack trace."""
    n = graph.call_function(target, args)
    n.meta["val"] = fake_run(target, args)
    if trace:
        n.meta["stack_trace"] = trace
    return n


def time_to_dim1(graph: fx.Graph, x: fx.Node, td: int, rank: int, trace: Any = None) -> fx.Node:
    """``x`` (right-aligned to ``rank`` dims, time at ``td``) reshaped/permuted so time is dim 1."""
    if x.meta["val"].dim() < rank:
        shape = [1] * (rank - x.meta["val"].dim()) + list(x.meta["val"].shape)
        x = emit_node(graph, aten.reshape.default, (x, shape), trace)
    if td == 1:
        return x
    perm = list(range(rank))
    perm.insert(1, perm.pop(td))
    return emit_node(graph, aten.permute.default, (x, perm), trace)


def time_from_dim1(graph: fx.Graph, x: fx.Node, td: int, rank: int, trace: Any = None) -> fx.Node:
    """Inverse of :func:`time_to_dim1` for a full-rank ``x``: time back to ``td``."""
    if td == 1:
        return x
    perm = list(range(rank))
    perm.insert(1, perm.pop(td))
    inv = [perm.index(i) for i in range(rank)]
    return emit_node(graph, aten.permute.default, (x, inv), trace)
