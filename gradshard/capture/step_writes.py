"""Canonical form: a fresh tensor filled one step at a time becomes a ``stack`` of the steps.

``out = torch.zeros_like(x); for t in range(T): out[:, t] = y_t`` is captured as
``T`` pairs ``copy_(select(out, 1, t), y_t)`` on a fresh allocation, and the later readers
of ``out`` see the writes only through the mutation. Every analysis reads data flow, so
:func:`stack_step_writes` rewrites the pattern to the value it computes::

    before:  out = zeros_like(x); copy_(select(out, 1, 0), y_0); ...; copy_(select(out, 1, T-1), y_{T-1})
             z = mul(out, g)
    after:   out' = stack([y_0, ..., y_{T-1}], 1);  z = mul(out', g)

The rewrite is exact and applied only when nothing can observe the difference: the buffer
comes from an allocator (its initial values are all overwritten), every index along the
written dim is written exactly once, each ``select`` is used only by its ``copy_`` (whose
result is unused), and every other use of the buffer comes after the last write. A step
value of another dtype or a broadcastable shape is cast and expanded as ``copy_`` does.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from gradshard.fake import fake_run

__all__ = ["stack_step_writes"]

aten = torch.ops.aten

#: Allocators whose initial values a full overwrite makes irrelevant.
_ALLOCATORS = {
    aten.zeros_like.default, aten.empty_like.default, aten.ones_like.default, aten.full_like.default,
    aten.zeros.default, aten.empty.memory_format, aten.ones.default, aten.full.default,
    aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default, aten.new_full.default,
}


def _val(node: object) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _step_writes(buf: fx.Node) -> tuple[int, dict[int, tuple[fx.Node, fx.Node]], list[fx.Node]] | None:
    """``(dim, {index: (select, copy_)}, other users)`` of a buffer written by per-step
    ``copy_`` into ``select`` along one dim, or None when ``buf`` is not written that way."""
    rank = len(_val(buf).shape)
    dim: int | None = None
    writes: dict[int, tuple[fx.Node, fx.Node]] = {}
    others: list[fx.Node] = []
    for user in buf.users:
        is_select = user.target is aten.select.int and user.args[0] is buf
        users = list(user.users) if is_select else []
        copy = users[0] if len(users) == 1 else None
        if copy is None or copy.target is not aten.copy_.default or copy.args[0] is not user or copy.users:
            others.append(user)
            continue
        d, i = user.args[1] % rank, int(user.args[2])
        i = i % _val(buf).shape[d]
        if (dim is not None and d != dim) or i in writes:
            return None
        dim = d
        writes[i] = (user, copy)
    if dim is None or sorted(writes) != list(range(_val(buf).shape[dim])):
        return None
    return dim, writes, others


def _as_written(graph: fx.Graph, value: fx.Node, target: torch.Tensor) -> fx.Node:
    """``value`` as ``copy_`` writes it into ``target``: cast to its dtype, broadcast to its shape."""
    v = _val(value)
    if v.dtype != target.dtype:
        value = _emit(graph, aten.to.dtype, (value, target.dtype), value)
    if tuple(v.shape) != tuple(target.shape):
        value = _emit(graph, aten.expand.default, (value, list(target.shape)), value)
    return value


def _emit(graph: fx.Graph, op: object, args: tuple, like: fx.Node) -> fx.Node:
    node = graph.call_function(op, args)
    node.meta = {k: like.meta[k] for k in ("stack_trace", "nn_module_stack") if k in like.meta}
    node.meta["val"] = fake_run(op, args)
    return node


def stack_step_writes(gm: fx.GraphModule) -> int:
    """Replace every fresh buffer filled by per-step ``copy_`` writes (see module doc) with a
    ``stack`` of the written values; return the number of buffers replaced."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    changed = 0
    for buf in list(graph.nodes):
        if buf.op != "call_function" or buf.target not in _ALLOCATORS or _val(buf) is None or not buf.users:
            continue
        found = _step_writes(buf)
        if found is None:
            continue
        dim, writes, others = found
        last = max((copy for _, copy in writes.values()), key=order.__getitem__)
        if any(order[u] < order[last] for u in others):
            continue  # something reads the partly filled buffer
        target = _val(writes[0][0])
        values = [writes[i][1].args[1] for i in range(len(writes))]
        if not all(_val(v) is not None and _val(v).device == target.device for v in values):
            continue
        with graph.inserting_before(last.next):  # after the last write, in order
            pieces = [_as_written(graph, v, target) for v in values]
            stacked = _emit(graph, aten.stack.default, (pieces, dim), last)
        buf.replace_all_uses_with(stacked, delete_user_cb=lambda u: u in others)
        for sel, copy in writes.values():
            graph.erase_node(copy)
            graph.erase_node(sel)
        if not buf.users:
            graph.erase_node(buf)
        order = {n: i for i, n in enumerate(graph.nodes)}
        changed += 1
    return changed
