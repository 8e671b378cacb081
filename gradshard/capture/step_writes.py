"""Canonical form: a fresh tensor filled piece by piece becomes a ``stack`` or ``cat`` of the pieces.

``out = torch.zeros_like(x); for t in range(T): out[:, t] = y_t`` is captured as
``T`` pairs ``copy_(select(out, 1, t), y_t)`` on a fresh allocation, and the later readers
of ``out`` see the writes only through the mutation. Every analysis reads data flow, so
:func:`stack_step_writes` rewrites the pattern to the value it computes::

    before:  out = zeros_like(x); copy_(select(out, 1, 0), y_0); ...; copy_(select(out, 1, T-1), y_{T-1})
             z = mul(out, g)
    after:   out' = stack([y_0, ..., y_{T-1}], 1);  z = mul(out', g)

Writes through ``slice`` views are the same form with ``cat`` (``k = x.new_empty(...);
k[..., :d] = k_nope; k[..., d:] = k_rope``: transformers' DeepSeek-V3 attention builds its keys
so), and a mix of the two ``cat``s the selected steps as slices of length one.

The rewrite is exact and applied only when nothing can observe the difference: the buffer
comes from an allocator (its initial values are all overwritten), the written pieces tile
the written dim exactly once, each view is used only by its ``copy_`` (whose result is
unused), and every other use of the buffer comes after the last write. A value of another
dtype or a broadcastable shape is cast and expanded as ``copy_`` does.
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


def _piece(view: fx.Node, buf: fx.Node, rank: int) -> tuple[int, int, int] | None:
    """``(dim, start, end)`` of ``buf`` that ``view`` (a ``select`` or unit-step ``slice`` of it) covers."""
    size = _val(buf).shape
    if view.target is aten.select.int:
        d = view.args[1] % rank
        i = int(view.args[2]) % size[d]
        return d, i, i + 1
    if view.target is aten.slice.Tensor:
        args = [*view.args, None, None, None, None][:5]
        d = (args[1] if args[1] is not None else view.kwargs.get("dim", 0)) % rank
        start = args[2] if args[2] is not None else view.kwargs.get("start")
        end = args[3] if args[3] is not None else view.kwargs.get("end")
        step = args[4] if args[4] is not None else view.kwargs.get("step", 1)
        if step != 1 or not all(isinstance(v, (int, type(None))) for v in (start, end)):
            return None
        start, end, _ = slice(start, end).indices(size[d])
        return (d, start, end) if end > start else None
    return None


def _step_writes(buf: fx.Node) -> tuple[int, list[tuple[int, fx.Node, fx.Node]], list[fx.Node]] | None:
    """``(dim, [(start, view, copy_)] in order, other users)`` of a buffer whose pieces along one
    dim are each written once by a ``copy_`` into a ``select`` or ``slice`` of it, tiling the dim;
    None when ``buf`` is not written that way."""
    rank = len(_val(buf).shape)
    dim: int | None = None
    writes: list[tuple[int, int, fx.Node, fx.Node]] = []
    others: list[fx.Node] = []
    for user in buf.users:
        piece = _piece(user, buf, rank) if user.args and user.args[0] is buf else None
        users = list(user.users) if piece is not None else []
        copy = users[0] if len(users) == 1 else None
        if copy is None or copy.target is not aten.copy_.default or copy.args[0] is not user or copy.users:
            others.append(user)
            continue
        d, start, end = piece
        if dim is not None and d != dim:
            return None
        dim = d
        writes.append((start, end, user, copy))
    if dim is None:
        return None
    writes.sort(key=lambda w: w[0])
    ends = [0] + [end for _, end, _, _ in writes]
    if [start for start, _, _, _ in writes] != ends[:-1] or ends[-1] != _val(buf).shape[dim]:
        return None  # a gap, an overlap, or a piece written twice
    return dim, [(start, view, copy) for start, _, view, copy in writes], others


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
    """Replace every fresh buffer filled piece by piece by ``copy_`` writes (see module doc) with a
    ``stack`` or ``cat`` of the written values; return the number of buffers replaced."""
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
        last = max((copy for _, _, copy in writes), key=order.__getitem__)
        if any(order[u] < order[last] for u in others):
            continue  # something reads the partly filled buffer
        values = [copy.args[1] for _, _, copy in writes]
        if not all(_val(v) is not None and _val(v).device == _val(buf).device for v in values):
            continue
        steps = all(view.target is aten.select.int for _, view, _ in writes)
        with graph.inserting_before(last.next):  # after the last write, in order
            pieces = [_as_written(graph, v, _val(view)) for (_, view, _), v in zip(writes, values)]
            if steps:
                joined = _emit(graph, aten.stack.default, (pieces, dim), last)
            else:
                pieces = [_emit(graph, aten.unsqueeze.default, (p, dim), last) if view.target is aten.select.int else p
                          for p, (_, view, _) in zip(pieces, writes)]
                joined = _emit(graph, aten.cat.default, (pieces, dim), last)
        buf.replace_all_uses_with(joined, delete_user_cb=lambda u: u in others)
        for _, view, copy in writes:
            graph.erase_node(copy)
            graph.erase_node(view)
        if not buf.users:
            graph.erase_node(buf)
        order = {n: i for i, n in enumerate(graph.nodes)}
        changed += 1
    return changed
