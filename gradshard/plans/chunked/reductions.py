"""Losses and other whole-sequence reductions, split into one partial per chunk.

A loss inside the compiled function (``F.cross_entropy(logits.reshape(-1, V), labels)``)
is a reduction over every step. It splits exactly when it is a sum, or a sum divided by a
count that does not need gradients::

    sum(x)                         = sum_j sum(x_j)
    mean(x)                        = sum_j sum(x_j) / numel(x)
    cross_entropy(x, y, mean)      = sum_j CE(x_j, y_j, sum) / sum_j n_j
                                     n_j = #(y_j != ignore_index)   (or sum of class weights)

so the chunked program computes, per chunk, the partial numerator (with grad) and the
partial denominator (without), and the backward seeds chunk ``j``'s numerator with
``dL/dR / denominator``. Full-sequence logits are never materialised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from gradshard.errors import node_error

aten = torch.ops.aten

__all__ = ["Reduction", "make_reduction"]

_SUM_OPS = (aten.sum.default, aten.sum.dim_IntList)
_MEAN_OPS = (aten.mean.default, aten.mean.dim)
_CLASS_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)
_ELEMENT_LOSSES = (aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
                   aten.binary_cross_entropy_with_logits.default)


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _shape(node: Any) -> tuple[int, ...]:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


@dataclass(frozen=True)
class Reduction:
    """How one whole-sequence reduction splits into per-chunk partials (see module doc).

    ``kind``: ``sum`` (R = sum of partials), ``mean`` (divided by ``count``), ``ratio``
    (divided by the sum of per-chunk denominators).
    """

    node: str
    kind: str
    count: float = 1.0

    def partial(self, node: fx.Node, ev: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(numerator, denominator)`` of this reduction on the evaluator's chunk."""
        prog = ev.program
        vals = []
        for a in prog.slots[node.name]:
            vals.append(ev.chunk_value(a.name) if prog.rules[a.name].frame else ev.value(a, ()))
        it = iter(vals)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: next(it))
        t = node.target
        if t in _SUM_OPS:
            return t(*args, **kwargs), None
        if t is aten.mean.default:
            return aten.sum.default(args[0], dtype=kwargs.get("dtype")), None
        if t is aten.mean.dim:
            dims = args[1] if len(args) > 1 else kwargs.get("dim")
            keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            return aten.sum.dim_IntList(args[0], dims, keep, dtype=kwargs.get("dtype")), None
        if t in _ELEMENT_LOSSES:
            args = list(args)
            pos = {aten.binary_cross_entropy_with_logits.default: 4}.get(t, 2)
            kwargs = dict(kwargs)
            if len(args) > pos:
                args[pos] = 2
            else:
                kwargs["reduction"] = 2
            return t(*args, **kwargs), None
        # class losses: (input, target, weight, reduction, ignore_index, ...)
        args = list(args)
        while len(args) < 5:
            args.append({2: None, 3: 1, 4: -100}[len(args)])
        reduction = args[3]
        args[3] = 2
        num = t(*args, **kwargs)
        if reduction == 2:
            return num, None
        x, target, weight, ignore = args[0], args[1], args[2], args[4]
        if target.is_floating_point():  # class probabilities: mean over rows
            n = x.numel() // x.shape[1] if x.dim() > 1 else 1
            return num, torch.tensor(float(n), dtype=num.dtype, device=num.device)
        valid = target != ignore
        if weight is None:
            den = valid.sum().to(num.dtype)
        else:
            den = (weight[target.clamp(min=0)] * valid).sum().to(num.dtype)
        return num, den


def make_reduction(node: fx.Node) -> Reduction:
    """The :class:`Reduction` of a whole-sequence reduction node, or an error saying why not."""
    t = node.target
    if t in _SUM_OPS:
        return Reduction(node.name, "sum")
    if t in _MEAN_OPS:
        shp = _shape(node.args[0])
        dims = _arg(node, 1, "dim") if t is aten.mean.dim else None
        if isinstance(dims, int):
            dims = [dims]
        count = math.prod(shp) if not dims else math.prod(shp[d] for d in dims)
        return Reduction(node.name, "mean", float(count))
    if t in _ELEMENT_LOSSES:
        red = _arg(node, 4 if t is aten.binary_cross_entropy_with_logits.default else 2, "reduction", 1)
        if red == 2:
            return Reduction(node.name, "sum")
        shp = torch.broadcast_shapes(_shape(node.args[0]), _shape(node.args[1]))
        return Reduction(node.name, "mean", float(math.prod(shp)))
    if t in _CLASS_LOSSES:
        red = _arg(node, 3, "reduction", 1)
        return Reduction(node.name, "sum" if red == 2 else "ratio")
    raise node_error(node, f"reduces over the whole sequence with `{getattr(t, '__name__', t)}`, which "
                     "does not split into a sum over chunks",
                     "reduce with sum/mean/cross_entropy (mean or sum), or return the per-token values "
                     "and reduce them outside the compiled function")
