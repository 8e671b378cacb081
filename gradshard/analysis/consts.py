"""Constant folding for analyses: evaluate a node that depends on no graph input."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

__all__ = ["evaluate_constant"]

_MAX_ELEMENTS = 1 << 24


def evaluate_constant(node: fx.Node, known: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
    """The value of ``node`` if it is computed from constants only (e.g. a causal mask
    built with ``torch.full(...).triu(1)``), else ``None``. Analyses use it to read masks;
    the traced ``meta['val']`` holds fake tensors without data.

    ``known`` gives values for placeholders that may be read (parameters and buffers without
    a time axis, e.g. a per-head decay rate inside a decay mask); other placeholders make
    the node non-constant."""
    known = known or {}
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op == "placeholder" and n.name in known:
            seen.add(n)
            order.append(n)
            continue
        if n.op in ("placeholder", "output") or n.op != "call_function":
            if n.op == "get_attr":
                seen.add(n)
                order.append(n)
                continue
            return None
        seen.add(n)
        order.append(n)
        stack.extend(n.all_input_nodes)
    env: dict[fx.Node, Any] = {}
    gm = node.graph.owning_module
    for n in reversed(_topo(order)):
        if n.op == "get_attr":
            env[n] = getattr(gm, n.target)
            continue
        if n.op == "placeholder":
            env[n] = known[n.name].detach()
            continue
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() > _MAX_ELEMENTS:
            return None
        args = fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
        try:
            env[n] = n.target(*args, **kwargs)
        except Exception:
            return None
    out = env.get(node)
    return out if isinstance(out, torch.Tensor) else None


def _topo(nodes: list[fx.Node]) -> list[fx.Node]:
    """Reverse topological order of ``nodes`` by their position in the graph."""
    index = {n: i for i, n in enumerate(nodes[0].graph.nodes)} if nodes else {}
    return sorted(nodes, key=lambda n: -index[n])
