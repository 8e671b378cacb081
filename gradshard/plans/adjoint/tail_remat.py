"""Recompute a time-local segment's input inside it, from the segment's other inputs.

A segment after a recurrence often reads a value computed before the recurrence from the
same residual stream it reads anyway: Mamba's gate, ``z = in_proj(norm(h))[..., :d_inner]``,
beside ``h`` for the residual add. Keeping ``z`` costs a ``(T, d_inner)`` tensor per layer;
recomputing it in each shard from ``h`` costs one more matmul per shard::

    before:  segment(y, z, h) -> h + out_proj(y * silu(z))            keeps y, z, h
    after:   segment(y, h)    -> h + out_proj(y * silu(in_proj(norm(h))[..., :d_inner]))

:func:`rematerialize_segment_inputs` copies such a producer chain into the segment's node set
(new graph nodes; the original stays for its other readers). A chain qualifies when its
nodes are candidates without a halo (pointwise in time, or splits beside time), it has at
most :data:`MAX_CHAIN` nodes, every time-carrying value it reads is another input of the
segment or kept anyway, and the segment then keeps fewer bytes. Exact: the same ops on the
same rows.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.plans.adjoint.time_local import boundary, halo_in_time, is_free, kept_bytes, timed

__all__ = ["MAX_CHAIN", "rematerialize_segment_inputs"]

MAX_CHAIN = 16  # a longer producer chain is not a cheap recomputation


def _bits(n: fx.Node) -> int:
    v = n.meta.get("val")
    return torch.finfo(v.dtype).bits if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else 0


def _chain(x: fx.Node, stop: set[fx.Node], barred: set[fx.Node], tl: Any, facts: dict) -> Optional[set[fx.Node]]:
    """The nodes computing ``x`` back to ``stop``, values without time, and graph inputs;
    ``None`` if one of them cannot be recomputed per shard, the chain is too long, or it computes
    in less precision than it reads (a float32 island in a float64 model: the copy's backward
    would round that island's gradient separately from the original's)."""
    nodes: set[fx.Node] = set()
    read = 0  # the most precise value the chain reads (parameters included)
    stack = [x]
    while stack:
        n = stack.pop()
        if n in nodes or n in stop or n.op in ("placeholder", "get_attr") or not timed(tl, n):
            read = max(read, _bits(n))
            continue
        if n in barred or n.op != "call_function" or halo_in_time(tl, facts, n) != 0:
            return None
        nodes.add(n)
        if len(nodes) > MAX_CHAIN:
            return None
        stack += n.all_input_nodes
    if any(0 < _bits(n) < read for n in nodes):
        return None
    return nodes


def _copy_chain(gm: fx.GraphModule, chain: list[fx.Node], x: fx.Node, readers: list[fx.Node],
                tl: Any, facts: dict) -> list[fx.Node]:
    """Copy ``chain`` (graph order) before the first of ``readers`` and point them at the copy of ``x``."""
    env: dict[fx.Node, fx.Node] = {}
    with gm.graph.inserting_before(readers[0]):
        for n in chain:
            new = gm.graph.node_copy(n, lambda a: env.get(a, a))
            env[n] = new
            tl.info[new.name] = tl.info[n.name]
            if n.name in facts:
                facts[new.name] = facts[n.name]
    for r in readers:
        r.replace_input_with(x, env[x])
    return list(env.values())


def rematerialize_segment_inputs(gm: fx.GraphModule, tl: Any, facts: dict, piece: set[fx.Node],
                                 free: set[fx.Node], barred: set[fx.Node]) -> set[fx.Node]:
    """``piece`` with copies of the chains computing its inputs where that keeps fewer bytes
    (see module doc). Changes ``gm``'s graph (and ``tl.info``/``facts`` for the copies)."""
    piece = set(piece)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inputs = sorted(boundary(piece)[0], key=order.get)
    for x in inputs:
        if x.op != "call_function" or is_free(x, free) or not timed(tl, x):
            continue
        current = boundary(piece)[0]
        chain = _chain(x, set(current) - {x} | free, barred, tl, facts)
        if not chain:
            continue
        readers = sorted((u for u in x.users if u in piece), key=order.get)
        new_inputs = boundary(piece | chain)[0]  # x is the chain's last node: no longer an input
        if kept_bytes(new_inputs, free) >= kept_bytes(current, free):
            continue
        if any(order[a] >= order[readers[0]] for a in boundary(chain)[0]):
            continue  # the copy would read a value computed after the segment starts reading x
        piece |= set(_copy_chain(gm, sorted(chain, key=order.get), x, readers, tl, facts))
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return piece
