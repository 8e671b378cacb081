"""Canonical forms the captured graph is put in before any analysis sees it.

Each rewrite is a small named function ``GraphModule -> int`` (the number of nodes it
changed), run in order by :func:`canonicalize`. They remove forms that are legal aten but
that every analysis would otherwise have to special-case.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from gradshard.capture.step_writes import stack_step_writes
from gradshard.ir import is_call_input

__all__ = ["canonicalize", "CANONICAL_REWRITES", "drop_empty_cat_pieces", "drop_noop_casts", "fold_transposed_weights"]

aten = torch.ops.aten
_CATS = (aten.cat.default, aten.concat.default, aten.concatenate.default)


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _is_legacy_empty(shape: tuple | None) -> bool:
    """A 1-d shape of size 0, known without a guard (a data-dependent size is never dropped)."""
    return shape is not None and len(shape) == 1 and type(shape[0]) is int and shape[0] == 0


def drop_empty_cat_pieces(gm: fx.GraphModule) -> int:
    """``cat([empty(0), x], d)`` -> ``cat([x], d)``: ``torch.cat`` skips legacy empty 1-d
    pieces of any rank (a transformers ``DynamicCache`` starts as ``torch.tensor([])``)."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _CATS:
            continue
        out = _shape(node)
        pieces = node.args[0]
        if out is None or len(out) <= 1 or not isinstance(pieces, (list, tuple)):
            continue
        kept = [p for p in pieces if not (isinstance(p, fx.Node) and _is_legacy_empty(_shape(p)))]
        if len(kept) == len(pieces) or not kept:
            continue
        node.args = (kept, *node.args[1:])
        changed += 1
    return changed


_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default)


def drop_noop_casts(gm: fx.GraphModule) -> int:
    """``x.to(x.dtype)`` -> ``x``: a cast to the dtype and device a tensor already has.

    Eager returns the same tensor, so code that casts its loop state each step
    (``h.to(input_dtype)`` in a float64 model) reads the cast as the state next step; the
    graph then threads the recurrence through a cast that does nothing."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _CASTS or not isinstance(node.args[0], fx.Node):
            continue
        src, out = node.args[0].meta.get("val"), node.meta.get("val")
        if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)):
            continue
        if node.kwargs.get("copy") or node.kwargs.get("memory_format") not in (None, torch.preserve_format):
            continue
        if (src.dtype, src.device, tuple(src.shape), src.requires_grad) != (out.dtype, out.device, tuple(out.shape), out.requires_grad):
            continue
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        changed += 1
    return changed


_TRANSPOSES = (aten.t.default, aten.numpy_T.default)


def _is_state(node: object) -> bool:
    """A parameter or buffer placeholder."""
    return isinstance(node, fx.Node) and node.op == "placeholder" and not is_call_input(node)


def fold_transposed_weights(gm: fx.GraphModule) -> int:
    """``matmul(x, t(W))`` -> ``linear(x, W)`` for a 2-D parameter or buffer ``W``.

    ``x @ self.weight.T`` (transformers' ``FalconLinear``, hand-written layers) is what
    ``aten.linear`` without a bias runs, bit for bit; as a ``linear`` the projection is one
    op every analysis knows (partial updates slice it)."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.matmul.default or len(node.args) != 2:
            continue
        x, wt = node.args
        if not (isinstance(wt, fx.Node) and wt.op == "call_function" and wt.target in _TRANSPOSES
                and _is_state(wt.args[0]) and _shape(wt.args[0]) is not None and len(_shape(wt.args[0])) == 2):
            continue
        node.target, node.args = aten.linear.default, (x, wt.args[0])
        if not wt.users:
            gm.graph.erase_node(wt)
        changed += 1
    return changed


#: The rewrites, in order (independent of one another so far).
CANONICAL_REWRITES: tuple[Callable[[fx.GraphModule], int], ...] = (drop_empty_cat_pieces, drop_noop_casts,
                                                                     stack_step_writes, fold_transposed_weights)


def canonicalize(gm: fx.GraphModule) -> dict[str, int]:
    """Run every canonical rewrite, drop what became dead, and return the changes per rewrite."""
    counts = {fn.__name__: fn(gm) for fn in CANONICAL_REWRITES}
    if any(counts.values()):
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return counts
