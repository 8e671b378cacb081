"""Turn buffer updates made in forward into graph outputs (``functionalize_buffer_updates``).

A module that updates a buffer in forward (a step counter's ``add_``, BatchNorm's running
statistics, an EMA ``copy_``) mutates the buffer placeholder in the captured graph. Every
plan but ``none`` evaluates parts of the graph more than once (chunks, shards, self-checks),
so an in-place update there would run the wrong number of times. This pass rewrites each
whole-buffer update to its out-of-place op, makes later reads see the new value, and appends
the buffer's final value to the graph outputs; the caller writes it back once per call, as
eager does. An update through a view of a buffer (``buf[:, i] = x``) is refused: its
out-of-place form is not one op.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from gradshard.errors import CaptureError, node_error
from gradshard.fake import fake_run

__all__ = ["functionalize_buffer_updates", "unordered_mutations"]

aten = torch.ops.aten

# Ops through which a tensor is still the same storage (an update of it updates the buffer).
_VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten.slice.Tensor, aten.select.int, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.default, aten.expand.default, aten.narrow.default, aten.as_strided.default,
    aten.diagonal.default, aten.unfold.default, aten.alias.default, aten.detach.default,
}


def _mutated_args(node: fx.Node) -> list[fx.Node]:
    """The node arguments an op writes to (schema ``Tensor(a!)``)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node):
            out.append(value)
    return out


def _functional_overload(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``aten.add_.Tensor`` -> ``aten.add.Tensor`` (None when no out-of-place twin exists)."""
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    overload = target._overloadname
    return getattr(packet, overload, None) if packet is not None else None


def _root(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _VIEW_OPS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _base_buffer(node: fx.Node, owner: dict[fx.Node, int]) -> int | None:
    return owner.get(_root(node))


def functionalize_buffer_updates(gm: fx.GraphModule, buffer_placeholders: Sequence[fx.Node],
                                 buffer_names: Sequence[str]) -> tuple[int, ...]:
    """Rewrite in-place updates of buffers to out-of-place ops and return their new values.

    Appends one graph output per updated buffer, after the model's own outputs, and returns
    the updated buffers' indices (into ``buffer_placeholders``) in that order.
    """
    graph = gm.graph
    owner: dict[fx.Node, int] = {ph: i for i, ph in enumerate(buffer_placeholders)}
    latest: dict[int, fx.Node] = {}

    def current(a: Any) -> Any:
        if isinstance(a, fx.Node) and a in owner and owner[a] in latest:
            return latest[owner[a]]
        return a

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        node.args = fx.node.map_arg(node.args, current)
        node.kwargs = fx.node.map_arg(node.kwargs, current)
        if node.target is aten.batch_norm.default and _updates_running_stats(node, owner):
            _functionalize_batch_norm(gm, node, owner, latest)
            continue
        for written in _mutated_args(node):
            b = _base_buffer(written, owner)
            if b is None:
                continue
            if written not in owner:
                raise node_error(node, f"buffer `{buffer_names[b]}` is updated in place through a view of "
                                 "it; gradshard turns buffer updates into new values of the whole buffer",
                                 "compute the new buffer and assign it whole (`self.buf.copy_(new)` or "
                                 "`self.buf = new`)", CaptureError)
            functional = _functional_overload(node.target)
            if functional is None or written is not node.args[0]:
                raise node_error(node, f"buffer `{buffer_names[b]}` is updated by an op with no "
                                 "out-of-place form", "compute the new value out of place and "
                                 "`copy_` it into the buffer", CaptureError)
            with graph.inserting_before(node):
                new = graph.call_function(functional, node.args, node.kwargs)
            new.meta = dict(node.meta)
            new.meta["val"] = fake_run(functional, new.args, new.kwargs)
            old_val = node.meta.get("val")
            if isinstance(old_val, torch.Tensor) and isinstance(new.meta["val"], torch.Tensor) and (
                    new.meta["val"].shape != old_val.shape or new.meta["val"].dtype != old_val.dtype):
                raise node_error(node, f"the update of buffer `{buffer_names[b]}` changes its shape or dtype",
                                 "keep the buffer's shape and dtype in the update", CaptureError)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            owner[new] = b
            latest[b] = new
    updated = tuple(sorted(latest))
    if updated:
        out = next(iter(graph.find_nodes(op="output")))
        out.args = (list(out.args[0]) + [latest[b] for b in updated],)
    graph.lint()
    gm.recompile()
    return updated


def _updates_running_stats(node: fx.Node, owner: dict[fx.Node, int]) -> bool:
    """``batch_norm(x, w, b, running_mean, running_var, training=True, ...)`` on buffers."""
    args = node.args
    return len(args) > 5 and args[5] is True and any(_base_buffer(a, owner) is not None
                                                     for a in args[3:5] if isinstance(a, fx.Node))


def _functionalize_batch_norm(gm: fx.GraphModule, node: fx.Node, owner: dict[fx.Node, int],
                              latest: dict[int, fx.Node]) -> None:
    """``batch_norm`` (training, updating running stats) -> ``_native_batch_norm_legit_functional``,
    whose 4th and 5th outputs are the new running mean and variance."""
    x, w, b, rm, rv, _training, momentum, eps = node.args[:8]
    for stat in (rm, rv):
        if not isinstance(stat, fx.Node) or stat not in owner:
            raise node_error(node, "batch norm updates running statistics that are views of a buffer",
                             "register running_mean / running_var as whole buffers", CaptureError)
    graph = gm.graph
    op = aten._native_batch_norm_legit_functional.default
    with graph.inserting_before(node):
        fn = graph.call_function(op, (x, w, b, rm, rv, True, momentum, eps))
        fn.meta = dict(node.meta)
        fn.meta["val"] = fake_run(op, fn.args)
        parts = []
        for i in range(5):
            g = graph.call_function(operator.getitem, (fn, i))
            g.meta = dict(node.meta)
            g.meta["val"] = fn.meta["val"][i] if fn.meta["val"] is not None else None
            parts.append(g)
    node.replace_all_uses_with(parts[0])
    graph.erase_node(node)
    for stat, new in ((rm, parts[3]), (rv, parts[4])):
        owner[new] = owner[stat]
        latest[owner[stat]] = new


def _aliases(base: fx.Node) -> set[fx.Node]:
    """``base`` and every node that is the same storage: views of it and in-place ops on it,
    transitively."""
    seen = {base}
    stack = [base]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen or u.op != "call_function" or not u.args or u.args[0] is not n:
                continue
            if u.target in _VIEW_OPS or n in _mutated_args(u):
                seen.add(u)
                stack.append(u)
    return seen


def unordered_mutations(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """In-place writes whose effect the graph's data flow does not show: ``(mutation, reader)``
    pairs where ``reader`` runs after ``mutation`` and reads the written storage through a
    node that does not depend on the mutation (the tensor itself, or a view of it taken
    before). Replayed in order the graph computes the model's function; a pass that moves,
    splits or repeats nodes along their data flow (chunks, shards) would read the storage
    before the write. Writes into graph inputs are the capture's business, not listed here."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found: list[tuple[fx.Node, fx.Node]] = []
    for m in gm.graph.nodes:
        if m.op != "call_function":
            continue
        for written in _mutated_args(m):
            base = _root(written)
            if base.op == "placeholder":
                continue
            after_m = _aliases(m)  # what reads the storage through m's own result depends on m
            for a in _aliases(base) - after_m:
                reader = next((u for u in a.users if order[u] > order[m] and u not in after_m
                               and not (u.target in _VIEW_OPS and u.args[0] is a)), None)
                if reader is not None:
                    found.append((m, reader))
                    break
    return found
