"""The split-matmul linear of partial updates: weight gradients for the trainable slice only.

:func:`partial_linear` is ``F.linear(x, W, b)`` with ``W`` given as its runs; the backward
propagates the input gradient through every run but forms the weight (and split-bias)
gradients of the runs of ``layout.index`` only, so the frozen slices' weight-gradient GEMMs
are really skipped.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.autograd.function import once_differentiable

from gradshard.plans.partial_update.layout import PartialUpdateError, SliceLayout

Tensor = torch.Tensor

__all__ = ["partial_linear"]


class _PartialLinearFn(torch.autograd.Function):
    """Split-matmul linear; weight gradients for the runs of ``layout.index`` only (see module doc).

    ``bias_mode``: ``"none"``; ``"split"`` (dim 0: one bias piece per run after the
    weights); ``"whole"`` (one full bias after the weights, any dim).
    """

    @staticmethod
    def forward(ctx, x: Tensor, layout: SliceLayout, bias_mode: str, *tensors: Tensor) -> Tensor:
        r = layout.num_runs
        weights, rest = tensors[:r], tensors[r:]
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if layout.dim == 0:
            parts = []
            for i, w in enumerate(weights):
                lo, hi = layout.span(i)
                b = rest[i] if bias_mode == "split" else rest[0][lo:hi] if bias_mode == "whole" else None
                parts.append(torch.mm(x2, w.t()) if b is None else torch.addmm(b, x2, w.t()))
            y = torch.cat(parts, dim=1)
        else:
            y = None
            for i, w in enumerate(weights):
                lo, hi = layout.span(i)
                xs = x2[:, lo:hi]
                if y is None:
                    y = torch.mm(xs, w.t()) if bias_mode == "none" else torch.addmm(rest[0], xs, w.t())
                else:  # out= (not addmm_): in place, and visible to FlopCounterMode
                    torch.addmm(y, xs, w.t(), out=y)
        ctx.layout, ctx.bias_mode, ctx.x_shape = layout, bias_mode, x.shape
        ctx.save_for_backward(x2, *weights)
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: Tensor):
        layout: SliceLayout = ctx.layout
        x2, *weights = ctx.saved_tensors
        r = layout.num_runs
        trained = layout.trainable_runs
        gy2 = gy.reshape(-1, gy.shape[-1])
        need = ctx.needs_input_grad
        gx = None
        gws: list[Tensor | None] = [None] * r
        if layout.dim == 0:
            if need[0]:
                for i, w in enumerate(weights):
                    lo, hi = layout.span(i)
                    if gx is None:
                        gx = torch.mm(gy2[:, lo:hi], w)
                    else:
                        torch.addmm(gx, gy2[:, lo:hi], w, out=gx)
            for i in trained:
                if need[3 + i]:
                    lo, hi = layout.span(i)
                    gws[i] = torch.mm(gy2[:, lo:hi].t(), x2)
        else:
            if need[0]:
                gx = torch.cat([torch.mm(gy2, w) for w in weights], dim=1)
            for i in trained:
                if need[3 + i]:
                    lo, hi = layout.span(i)
                    gws[i] = torch.mm(gy2.t(), x2[:, lo:hi])
        gbias: list[Tensor | None] = []
        if ctx.bias_mode == "split":
            gbias = [None] * r
            for i in trained:
                if need[3 + r + i]:
                    lo, hi = layout.span(i)
                    gbias[i] = gy2[:, lo:hi].sum(0)
        elif ctx.bias_mode == "whole":
            gbias = [gy2.sum(0) if need[3 + r] else None]
        if gx is not None:
            gx = gx.reshape(ctx.x_shape)
        return (gx, None, None, *gws, *gbias)


def partial_linear(
    x: Tensor,
    weights: Sequence[Tensor],
    layout: SliceLayout,
    bias: Tensor | Sequence[Tensor] | None = None,
) -> Tensor:
    """``F.linear(x, W, b)`` with ``W`` given as its runs; weight grad for slice ``layout.index`` only.

    ``weights`` are the ``R`` runs of ``W`` in order along ``layout.dim`` (shape ``(out_n,
    in)`` or ``(out, in_n)``). ``bias``: None; the full bias as one tensor (trained whole:
    its gradient is the full bias gradient); or, for ``dim=0``, a sequence of ``R`` bias
    pieces split like the weight. Only the trainable runs (and their bias pieces) may
    require grad: a frozen run that requires grad would silently get no gradient, so it
    is an error.
    """
    r = layout.num_runs
    if len(weights) != r:
        raise PartialUpdateError(f"partial_linear: got {len(weights)} weight slices, layout has {r}")
    for i, w in enumerate(weights):
        lo, hi = layout.span(i)
        other = w.shape[1 - layout.dim] if w.dim() == 2 else None
        if w.dim() != 2 or w.shape[layout.dim] != hi - lo or other != weights[0].shape[1 - layout.dim]:
            raise PartialUpdateError(
                f"partial_linear: weight slice {i} has shape {tuple(w.shape)}, expected size "
                f"{hi - lo} along dim {layout.dim} and matching other dims"
            )
        if layout.owner(i) != layout.index and w.requires_grad:
            raise PartialUpdateError(
                f"partial_linear: frozen weight slice {i} requires grad but would receive none; "
                f"detach it or make slice {layout.owner(i)} the trainable one (layout.index)"
            )
    in_features = layout.size if layout.dim == 1 else weights[0].shape[1]
    out_features = weights[0].shape[0] if layout.dim == 1 else layout.size
    if x.shape[-1] != in_features:
        raise PartialUpdateError(
            f"partial_linear: input has {x.shape[-1]} features, the weight expects {in_features}"
        )
    biases: tuple[Tensor, ...] = ()
    mode = "none"
    if isinstance(bias, torch.Tensor):
        if tuple(bias.shape) != (out_features,):
            raise PartialUpdateError(
                f"partial_linear: the bias has shape {tuple(bias.shape)}, expected ({out_features},)"
            )
        biases, mode = (bias,), "whole"
    elif bias is not None:
        if layout.dim != 0 or len(bias) != r:
            raise PartialUpdateError(
                "partial_linear: a split bias needs an output-split (dim=0) layout and one bias "
                "piece per weight slice; pass the full bias as one tensor to train it whole"
            )
        biases, mode = tuple(bias), "split"
        for i, b in enumerate(biases):
            if layout.owner(i) != layout.index and b.requires_grad:
                raise PartialUpdateError(
                    f"partial_linear: frozen bias slice {i} requires grad but would receive none"
                )
    return _PartialLinearFn.apply(x, layout, mode, *weights, *biases)
