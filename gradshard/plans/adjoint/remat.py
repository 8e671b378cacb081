"""Region inputs the adjoint plans recompute instead of keeping (e.g. the token embedding).

An adjoint region keeps its time-carrying inputs for the backward: for layer 0 of a language
model that is ``embedding(W, ids)``, ``B*T*P`` floats, although the token ids (graph inputs
the caller holds anyway) and ``W`` (a parameter) determine it. When a region input is
computed, pointwise in time, from graph inputs, parameters and constants only, the region
keeps those instead and recomputes the input's window in each backward shard
(:class:`~gradshard.plans.adjoint.runtime.InputRemat`). The gradient still flows to the input
itself (and from there through the original producer, left in the graph), so nothing about
the gradient changes.

The recomputation may also start from a computed value another reader needs anyway -- the
residual stream a Mamba layer reads before its norm, ``in_proj`` and causal conv -- and read a
causal window (``conv1d``: each window starts ``halo`` steps early). A value is such an anchor
when some reader of it does not lead to the region input (the residual add beside the norm);
the region then keeps the anchor (the same tensor its other reader keeps) instead of several
wider inputs, when that keeps fewer bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.analysis.node_costs import tensor_bytes
from gradshard.pipeline import ancestors
from gradshard.plans.adjoint.time_local import full_time_dim, halo_in_time, path_halo, timed, value_of

__all__ = ["InputRematPlan", "find_input_remats", "MAX_REMAT_NODES"]

MAX_REMAT_NODES = 24  # a recomputation longer than this is not "cheap" (norm, in_proj, conv: ~16)


@dataclass(frozen=True)
class InputRematPlan:
    """Region input ``index`` is recomputed by ``nodes`` from ``leaves`` (graph inputs, parameters,
    anchors), reading ``halo`` steps before each window."""

    index: int
    nodes: tuple[fx.Node, ...]  # graph order
    leaves: tuple[fx.Node, ...]
    leaf_time_dims: tuple[Optional[int], ...]
    halo: int = 0


def _recompute_from_leaves(tl: Any, facts: dict, x: fx.Node, order: dict[fx.Node, int],
                           barred: set[fx.Node]) -> Optional[tuple[list[fx.Node], list[fx.Node]]]:
    """The nodes computing ``x`` from graph inputs, values without time and anchors (a tensor
    some reader of which does not lead to ``x``), each recomputable on a window of time."""
    up = ancestors([x])
    nodes: set[fx.Node] = set()
    leaves: dict[fx.Node, None] = {}
    stack = [x]
    while stack:
        n = stack.pop()
        if n in nodes or n in leaves:
            continue
        anchor = n is not x and isinstance(value_of(n), torch.Tensor) and any(u not in up for u in n.users)
        if n.op in ("placeholder", "get_attr") or not timed(tl, n) or anchor:
            if n in barred:
                return None  # a value inside a region (replaced by its call) is no leaf to pass
            leaves[n] = None
            continue
        if n in barred or halo_in_time(tl, facts, n) is None:
            return None
        nodes.add(n)
        if len(nodes) > MAX_REMAT_NODES:
            return None
        stack.extend(n.all_input_nodes)
    return sorted(nodes, key=order.get), sorted(leaves, key=order.get)


def _leaf_dims(tl: Any, facts: dict, leaves: list[fx.Node]) -> Optional[list[Optional[int]]]:
    dims: list[Optional[int]] = []
    for leaf in leaves:
        if timed(tl, leaf):
            d = full_time_dim(tl, facts, leaf)
            if d is None:
                return None
            dims.append(d)
        else:
            dims.append(None)
    return dims


def find_input_remats(gm: fx.GraphModule, tl: Any, facts: dict, inputs: list[fx.Node],
                      input_time_dims: tuple[Optional[int], ...],
                      barred: frozenset[fx.Node] = frozenset()) -> list[InputRematPlan]:
    """The time-carrying region ``inputs`` that are cheap functions of graph inputs and anchors,
    where recomputing them keeps fewer bytes (an anchor another chosen remat reads is counted
    once). ``barred``: nodes of recurrence regions (never recomputed here)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found: list[tuple[int, list[fx.Node], list[fx.Node], list[Optional[int]], int]] = []
    for i, (x, d) in enumerate(zip(inputs, input_time_dims)):
        if d is None or x.op != "call_function" or full_time_dim(tl, facts, x) != d:
            continue
        got = _recompute_from_leaves(tl, facts, x, order, set(barred))
        if got is None:
            continue
        nodes, leaves = got
        dims = _leaf_dims(tl, facts, leaves)
        if dims is None or all(dd is None for dd in dims):
            continue
        found.append((i, nodes, leaves, dims, path_halo(nodes, tl, facts)))
    # keep the remats while the bytes the region keeps go down: its inputs, then their anchors
    chosen: list[InputRematPlan] = []
    kept_leaves: set[fx.Node] = set()
    for i, nodes, leaves, dims, halo in sorted(found, key=lambda f: -tensor_bytes(value_of(inputs[f[0]]))):
        new = [leaf for leaf, dd in zip(leaves, dims) if dd is not None and leaf.op == "call_function"
               and leaf not in kept_leaves and leaf not in inputs]
        if sum(tensor_bytes(value_of(leaf)) for leaf in new) >= tensor_bytes(value_of(inputs[i])):
            continue
        kept_leaves.update(new)
        chosen.append(InputRematPlan(i, tuple(nodes), tuple(leaves), tuple(dims), halo))
    return sorted(chosen, key=lambda r: r.index)
