"""drop_right_padding: a prefix slice of pointwise math on right-padded values reads the values.

Block-form scans pad time up to a multiple of their block and cut the result back; what lies
between is pointwise. Mamba-2's SSD form (``transformers`` ``torch_forward``) adds the skip
connection on padded values::

    before:  out = (pad(y, right=k) + D * pad(x, right=k))[:, :T]
    after:   out = y + D * x

The padded steps never reach the slice, so reading the unpadded values is exact. For the time
analysis a ``pad`` and a ``slice`` are positional: the adjoint plans' time-local segments stop
at them and autograd keeps the padded copies; after this pass the skip joins the segment
around it. A pad of zero steps (a length already a multiple of the block) is dropped.

Matched: ``slice(z, dim, 0, L)`` (step 1) where every path from ``z`` back to a value of
another length passes only pointwise ops (``torch.Tag.pointwise``, not random, not in place)
and ends in ``pad``/``constant_pad_nd`` that pads ``dim`` on the right only, of an input of
length ``L``; operands broadcast along ``dim`` (size 1, or fewer dims) are read as they are.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.analysis.locality import analyze_time_locality
from gradshard.pipeline import PassContext, PassResult, graph_pass

from gradshard.passes.recurrence_graph import copy_graph_module, fake_run

aten = torch.ops.aten

__all__ = ["drop_right_padding"]

_PADS = (aten.pad.default, aten.constant_pad_nd.default)


def _shape(n: Any) -> Optional[tuple[int, ...]]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _prefix_slice(n: fx.Node) -> Optional[tuple[int, int]]:
    """``(dim, L)`` if ``n`` is ``x[..., 0:L]`` along ``dim`` with step 1."""
    if n.target is not aten.slice.Tensor or not isinstance(n.args[0], fx.Node):
        return None
    args = list(n.args) + [None] * (5 - len(n.args))
    src, out = _shape(n.args[0]), _shape(n)
    if src is None or out is None or args[2] not in (None, 0) or args[4] not in (None, 1):
        return None
    dim = (args[1] or 0) % len(src)
    return dim, out[dim]


def _unpadded(n: fx.Node, dim: int, length: int) -> Optional[fx.Node]:
    """The input of ``n`` if ``n`` pads only ``dim``, only on the right, a value of ``length``."""
    if n.target not in _PADS or not isinstance(n.args[0], fx.Node):
        return None
    if n.target is aten.pad.default and (len(n.args) > 2 and n.args[2] != "constant" or n.kwargs.get("mode", "constant") != "constant"):
        return None
    src = _shape(n.args[0])
    pads = list(n.args[1])
    if src is None or len(pads) % 2 or len(pads) // 2 > len(src) or src[dim] != length:
        return None
    for i in range(len(pads) // 2):  # pairs from the last dim backwards
        d = len(src) - 1 - i
        left, right = pads[2 * i], pads[2 * i + 1]
        if left != 0 or (right != 0 and d != dim):
            return None
    return n.args[0]


def _broadcast_along(a: fx.Node, dim: int, rank: int) -> bool:
    """Whether operand ``a`` of a ``rank``-dim pointwise op is broadcast along ``dim``."""
    shape = _shape(a)
    if shape is None:
        return False
    d = dim - (rank - len(shape))
    return d < 0 or shape[d] == 1


def _pointwise(n: fx.Node) -> bool:
    t = n.target
    return (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags
            and torch.Tag.nondeterministic_seeded not in t.tags and not t._schema.is_mutable)


def _cone(z: fx.Node, dim: int, length: int) -> Optional[dict[fx.Node, Optional[fx.Node]]]:
    """The padded values between the slice and the pads: node -> unpadded input (pads) or
    ``None`` (pointwise ops to rebuild); ``None`` if some path does not match."""
    padded = _shape(z)
    cone: dict[fx.Node, Optional[fx.Node]] = {}
    stack = [z]
    while stack:
        n = stack.pop()
        if n in cone:
            continue
        if _shape(n) is None or len(_shape(n)) != len(padded) or _shape(n)[dim] != padded[dim]:
            return None
        src = _unpadded(n, dim, length)
        if src is not None:
            cone[n] = src
            continue
        if not _pointwise(n):
            return None
        cone[n] = None
        stack += [a for a in n.all_input_nodes if not _broadcast_along(a, dim, len(padded))]
    return cone if any(v is not None for v in cone.values()) else None


def _rebuild(graph: fx.Graph, z: fx.Node, cone: dict[fx.Node, Optional[fx.Node]]) -> fx.Node:
    """``z``'s pointwise cone emitted again on the unpadded values (before the insertion point)."""
    env: dict[fx.Node, fx.Node] = {}

    def get(n: fx.Node) -> fx.Node:
        if n not in cone:
            return n  # broadcast operand
        if n not in env:
            if cone[n] is not None:
                env[n] = cone[n]
            else:
                args = fx.node.map_arg(n.args, get)
                kwargs = fx.node.map_arg(n.kwargs, get)
                new = graph.call_function(n.target, args, kwargs)
                new.meta["val"] = fake_run(n.target, args, kwargs)
                if "stack_trace" in n.meta:
                    new.meta["stack_trace"] = n.meta["stack_trace"]
                env[n] = new
        return env[n]

    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(cone, key=order.get):
        get(n)
    return get(z)


@graph_pass
def drop_right_padding(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Read the unpadded values where a prefix slice undoes a right pad through pointwise ops
    (see the module doc); recompute the time analysis if anything changed."""
    new = copy_graph_module(gm)
    graph = new.graph
    notes = []
    for p in list(graph.nodes):  # a pad of nothing (the length was a multiple of the block already)
        if p.target in _PADS and _shape(p) is not None and _shape(p) == _shape(p.args[0]) and not any(p.args[1]) \
                and _unpadded(p, 0, _shape(p)[0]) is not None:
            p.replace_all_uses_with(p.args[0])
            graph.erase_node(p)
            notes.append(f"{p.name}: pads nothing")
    for s in list(graph.nodes):
        got = _prefix_slice(s)
        if got is None:
            continue
        dim, length = got
        cone = _cone(s.args[0], dim, length)
        if cone is None:
            continue
        with graph.inserting_before(s):
            out = _rebuild(graph, s.args[0], cone)
        s.replace_all_uses_with(out)
        graph.erase_node(s)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for n in sorted(cone, key=order.get, reverse=True):  # the padded copies nothing reads now
            if not n.users:
                graph.erase_node(n)
        pads = sorted(p.name for p, src in cone.items() if src is not None)
        notes.append(f"{s.name}: reads {', '.join(pads)} unpadded ({len(cone) - len(pads)} pointwise node(s) rebuilt)")
    if not notes:
        return PassResult(gm, notes=("no right padding cut back by a slice",))
    graph.lint()
    new.recompile()
    if "time" in ctx.analyses:
        ctx.analyses["time"] = analyze_time_locality(new, time_axis=ctx.time_axis)
    return PassResult(new, changed=True, notes=tuple(notes))
