"""Reductions over time that a time-local segment may end in (a loss), and how to shard them.

A segment run shard by shard (:mod:`gradshard.plans.adjoint.local`) may return, besides
time-carrying outputs, a *reduction over time*: ``sum``/``mean`` over dims that include the
time dim, or ``cross_entropy`` (``reduction="sum"`` or ``"mean"``) over rows along time.
Each is a ratio of sums over rows, ``num / den``: the segment sums ``num`` and ``den`` over
shards and divides once, and in the backward each shard's ``num`` gets the output gradient
divided by the total ``den`` (``den`` has no gradient: a count, or the summed class weights
of the non-ignored targets). So the loss is computed shard by shard and the full-length
logits, their log-softmax and its gradient never exist at once.

The table :data:`REDUCTIONS` holds one rule per op: when the node is such a reduction
(:func:`time_reduction`), and how to rewrite it in the segment's graph into ``num`` (and
``den``) per shard (:func:`split_time_reductions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

aten = torch.ops.aten

__all__ = ["REDUCTIONS", "time_reduction", "split_time_reductions"]

_SUM, _MEAN = 2, 1  # torch's Reduction enum (0 is "none": pointwise, not a reduction)


@dataclass(frozen=True)
class ReductionRule:
    """``reduces(node, time_dim)``: whether ``node`` sums or averages over its input's time dim;
    ``split(graph, node)``: insert the per-shard numerator (and denominator, or ``None``)."""

    reduces: Callable[[fx.Node, int], bool]
    split: Callable[[fx.Graph, fx.Node], tuple[fx.Node, Optional[fx.Node]]]


def _ndim(a: object) -> int:
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else -1


def _dims(node: fx.Node) -> Optional[list[int]]:
    """The reduced dims of a ``sum``/``mean`` (normalised; all dims when none are named)."""
    nd = _ndim(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(nd))
    return [d % nd for d in ([dims] if isinstance(dims, int) else dims)]


def _keepdim(node: fx.Node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


def _reduces_time(node: fx.Node, time_dim: int) -> bool:
    dims = _dims(node)
    return dims is not None and time_dim in dims and not _keepdim(node)


def _split_sum(graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, Optional[fx.Node]]:
    return node, None


def _split_mean(graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, Optional[fx.Node]]:
    """``mean(x, dims)`` -> ``sum(x, dims)`` over ``sum(ones_like(x), dims)``."""
    x = node.args[0]
    dims = _dims(node)
    dtype = node.kwargs.get("dtype", node.args[3] if len(node.args) > 3 else None)
    with graph.inserting_before(node):
        num = graph.call_function(aten.sum.dim_IntList, (x, dims, False), {"dtype": dtype} if dtype else {})
        ones = graph.call_function(aten.ones_like.default, (x,), {"dtype": node.meta["val"].dtype})
        den = graph.call_function(aten.sum.dim_IntList, (ones, dims, False))
    node.replace_all_uses_with(num)
    graph.erase_node(node)
    return num, den


def _ce_args(node: fx.Node) -> tuple[fx.Node, fx.Node, Optional[fx.Node], int, int, float]:
    names = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    defaults = (None, None, None, _MEAN, -100, 0.0)
    got = [node.args[i] if i < len(node.args) else node.kwargs.get(k, d) for i, (k, d) in enumerate(zip(names, defaults))]
    return tuple(got)  # type: ignore[return-value]


def _ce_reduces(node: fx.Node, time_dim: int) -> bool:
    """Class-index targets, rows along time: ``x`` (N, C) with time on N, ``target`` (N,)."""
    x, target, _, reduction, _, _ = _ce_args(node)
    tv = target.meta.get("val") if isinstance(target, fx.Node) else None
    return (reduction in (_SUM, _MEAN) and time_dim == 0 and _ndim(x) == 2 and isinstance(tv, torch.Tensor)
            and tv.dim() == 1 and not tv.is_floating_point())


def _split_cross_entropy(graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, Optional[fx.Node]]:
    """A mean over the non-ignored targets -> the sum over them, over their summed class weights
    (their count without weights): torch's own denominator, label smoothing included."""
    x, target, weight, reduction, ignore, smoothing = _ce_args(node)
    if reduction == _SUM:
        return node, None
    dtype = node.meta["val"].dtype
    with graph.inserting_before(node):
        num = graph.call_function(aten.cross_entropy_loss.default, (x, target, weight, _SUM, ignore, smoothing))
        valid = graph.call_function(aten.ne.Scalar, (target, ignore))
        if weight is None:
            den = graph.call_function(aten.sum.default, (valid,), {"dtype": dtype})
        else:
            safe = graph.call_function(aten.where.ScalarOther, (valid, target, 0))
            w = graph.call_function(aten.index_select.default, (weight, 0, safe))
            kept = graph.call_function(aten.where.ScalarOther, (valid, w, 0.0))
            den = graph.call_function(aten.sum.default, (kept,), {"dtype": dtype})
    node.replace_all_uses_with(num)
    graph.erase_node(node)
    return num, den


REDUCTIONS: dict[object, ReductionRule] = {
    aten.sum.default: ReductionRule(_reduces_time, _split_sum),
    aten.sum.dim_IntList: ReductionRule(_reduces_time, _split_sum),
    aten.mean.default: ReductionRule(_reduces_time, _split_mean),
    aten.mean.dim: ReductionRule(_reduces_time, _split_mean),
    aten.cross_entropy_loss.default: ReductionRule(_ce_reduces, _split_cross_entropy),
}


def time_reduction(node: fx.Node, time_dim: Optional[int]) -> bool:
    """Whether ``node`` reduces its first input (time dim ``time_dim``) over time by a rule in
    :data:`REDUCTIONS`, leaving no time dim."""
    rule = REDUCTIONS.get(node.target) if node.op == "call_function" else None
    if rule is None or time_dim is None or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    return bool(node.meta["val"].is_floating_point()) and rule.reduces(node, time_dim)


def split_time_reductions(gm: fx.GraphModule, reduced: list[int]) -> list[Optional[int]]:
    """Rewrite the graph's outputs at positions ``reduced`` (reductions over time) into per-shard
    numerators, appending their denominators to the outputs (in place).

    Returns, per reduced output in order, the position of its denominator among the outputs
    (``None``: a plain sum, nothing to divide by).
    """
    graph = gm.graph
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(out_node.args[0])
    dens: list[Optional[int]] = []
    for i in reduced:
        node = outs[i]
        num, den = REDUCTIONS[node.target].split(graph, node)
        outs[i] = num
        if den is None:
            dens.append(None)
        else:
            dens.append(len(outs))
            outs.append(den)
    out_node.args = (tuple(outs),)
    graph.lint()
    gm.recompile()
    return dens
