"""Region inputs the adjoint plans recompute instead of keeping (e.g. the token embedding).

An adjoint region keeps its time-carrying inputs for the backward: for layer 0 of a language
model that is ``embedding(W, ids)``, ``B*T*P`` floats, although the token ids (graph inputs
the caller holds anyway) and ``W`` (a parameter) determine it. When a region input is
computed, pointwise in time, from graph inputs, parameters and constants only, the region
keeps those instead and recomputes the input's window in each backward shard
(:class:`~gradshard.plans.adjoint.runtime.InputRemat`). The gradient still flows to the input
itself (and from there through the original producer, left in the graph), so nothing about
the gradient changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.fx as fx

from gradshard.plans.adjoint.tail import full_time_dim, pointwise_in_time

__all__ = ["InputRematPlan", "find_input_remats", "MAX_REMAT_NODES"]

MAX_REMAT_NODES = 8  # a recomputation longer than this is not "cheap"


@dataclass(frozen=True)
class InputRematPlan:
    """Region input ``index`` is recomputed by ``nodes`` from ``leaves`` (graph inputs/params)."""

    index: int
    nodes: tuple[fx.Node, ...]  # graph order
    leaves: tuple[fx.Node, ...]
    leaf_time_dims: tuple[Optional[int], ...]


def _recompute_from_leaves(tl: Any, x: fx.Node, order: dict[fx.Node, int]) -> Optional[tuple[list[fx.Node], list[fx.Node]]]:
    nodes: set[fx.Node] = set()
    leaves: dict[fx.Node, None] = {}
    stack = [x]
    while stack:
        n = stack.pop()
        if n in nodes or n in leaves:
            continue
        if n.op in ("placeholder", "get_attr"):
            leaves[n] = None
            continue
        if not pointwise_in_time(tl, n):
            return None
        nodes.add(n)
        if len(nodes) > MAX_REMAT_NODES:
            return None
        stack.extend(n.all_input_nodes)
    return sorted(nodes, key=order.get), sorted(leaves, key=order.get)


def find_input_remats(gm: fx.GraphModule, tl: Any, facts: dict, inputs: list[fx.Node],
                      input_time_dims: tuple[Optional[int], ...]) -> list[InputRematPlan]:
    """The time-carrying region ``inputs`` that are cheap, pointwise functions of graph inputs."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for i, (x, d) in enumerate(zip(inputs, input_time_dims)):
        if d is None or x.op != "call_function" or full_time_dim(tl, facts, x) != d:
            continue
        found = _recompute_from_leaves(tl, x, order)
        if found is None:
            continue
        nodes, leaves = found
        dims: list[Optional[int]] = []
        for leaf in leaves:
            info = tl.info.get(leaf.name)
            if info is not None and info.time_dims:
                ld = full_time_dim(tl, facts, leaf)
                if ld is None:
                    break
                dims.append(ld)
            else:
                dims.append(None)
        else:
            if any(dd is not None for dd in dims):
                out.append(InputRematPlan(i, tuple(nodes), tuple(leaves), tuple(dims)))
    return out
