"""``gradshard::linear_scan``: the diagonal linear recurrence as one custom op, with its rules.

Shapes: ``u`` is ``(batch, time, *state)``; ``a`` has the same number of dimensions and
broadcasts to ``u`` (any of its dimensions may be 1: e.g. ``(B, T, H, 1, 1)`` for one scalar per
head, ``(1, T, *state)`` shared over the batch, ``(B, 1, *state)`` constant over time);
``h0`` is ``(batch, *state)``. Mixed dtypes promote; half inputs accumulate in float32.

Forward   ``h_t = a_t h_{t-1} + u_t`` (``h_0 = h0`` or 0).
Reverse   ``h_t = a_t h_{t+1} + u_t`` (``h_{T+1} = h0`` or 0).

Backward (forward direction; the reverse one mirrors it), with ``g = dL/dh``::

    lam_t = g_t + a_{t+1} lam_{t+1}      one reverse linear_scan (the same op, so it nests)
    dL/du_t = lam_t,  dL/da_t = lam_t h_{t-1},  dL/dh0 = a_1 lam_1

Tracing: ``make_fx(..., pre_dispatch=True)`` / ``torch.compile`` record a single
``torch.ops.gradshard.linear_scan.default`` node (backward: the same op with ``reverse`` flipped).

Registered with the op: its fake (shape) function, its VJP (one reverse scan), its time
rule (reads all of the past along dim 1) and its dims rule (``u``'s dims; ``a`` shares the
time axis). The kernels it runs are bound in :func:`gradshard.kernels.linear_scan.run_linear_scan`.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from gradshard.analysis import locality
from gradshard.analysis.dims import DimsContext, NodeDims, register_dim_rule
from gradshard.kernels.linear_scan import result_dtype, run_linear_scan, shift_coefficients

__all__ = ["LINEAR_SCAN", "scan_dims_rule", "linear_scan_flops"]

LINEAR_SCAN = "gradshard::linear_scan"


@torch.library.custom_op(LINEAR_SCAN, mutates_args=())
def _linear_scan_op(a: Tensor, u: Tensor, h0: Optional[Tensor], reverse: bool, backend: Optional[str]) -> Tensor:
    """Dispatcher-level op; see the module docstring."""
    return run_linear_scan(a, u, h0, reverse, backend)


@_linear_scan_op.register_fake
def _linear_scan_fake(a: Tensor, u: Tensor, h0: Optional[Tensor], reverse: bool, backend: Optional[str]) -> Tensor:
    return u.new_empty(u.shape, dtype=result_dtype(a, u, h0))


def _neighbour_states(h: Tensor, h0: Optional[Tensor], reverse: bool) -> Tensor:
    """``h_{t-1}`` (forward) or ``h_{t+1}`` (reverse), with ``h0`` (or 0) at the boundary."""
    edge = torch.zeros_like(h[:, :1]) if h0 is None else h0.unsqueeze(1).to(h.dtype)
    return torch.cat([h[:, 1:], edge], 1) if reverse else torch.cat([edge, h[:, :-1]], 1)


def _setup_context(ctx, inputs, output) -> None:
    a, u, h0, reverse, backend = inputs
    ctx.reverse, ctx.backend = reverse, backend
    ctx.dtypes = (a.dtype, u.dtype, None if h0 is None else h0.dtype)
    ctx.shapes = (tuple(a.shape), tuple(u.shape))
    ctx.save_for_backward(a, h0, output)


def _backward(ctx, grad: Tensor):
    a, h0, h = ctx.saved_tensors
    reverse, (a_shape, u_shape) = ctx.reverse, ctx.shapes
    if grad is None:
        return None, None, None, None, None
    length = u_shape[1]
    lam = torch.ops.gradshard.linear_scan(
        shift_coefficients(a, length, reverse), grad, None, not reverse, ctx.backend
    )
    need_a, need_u, need_h0 = ctx.needs_input_grad[:3]
    da = (lam * _neighbour_states(h, h0, reverse)).sum_to_size(a_shape).to(ctx.dtypes[0]) if need_a else None
    du = lam.to(ctx.dtypes[1]) if need_u else None
    dh0 = None
    if need_h0 and h0 is not None and length > 0:
        idx = 0 if not reverse else -1
        a_edge = a[:, 0] if a.shape[1] == 1 else a[:, idx]
        dh0 = (a_edge * lam[:, idx]).to(ctx.dtypes[2])
    elif need_h0 and h0 is not None:
        dh0 = torch.zeros_like(h0)
    return da, du, dh0, None, None


_linear_scan_op.register_autograd(_backward, setup_context=_setup_context)




def scan_dims_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    """Dims of a scan: ``u``'s (args[1]); ``a`` (args[0]) shares the time axis."""
    a, u = node.args[0], node.args[1]
    ud = ctx.dims(u)
    ad = ctx.dims(a)
    if len(ad) == len(ud) and ad:
        ctx.union(ad[1] | ud[1])
    return NodeDims(tuple(ud), frozenset())


register_dim_rule(torch.ops.gradshard.linear_scan, LINEAR_SCAN)(scan_dims_rule)
locality.register_time_op(LINEAR_SCAN, time_dim=1, reach=locality.ALL_PAST)


# --------------------------------------------------------------------------- FLOPs (FlopCounterMode)

Shape = Sequence[Any]  # ints, or SymInts while tracing symbolically


def linear_scan_flops(h_shape: Shape) -> int:
    """``h_t = a_t h_{t-1} + u_t``: one multiply and one add per element of ``h`` (``u``'s shape)."""
    return 2 * math.prod(h_shape)


def _linear_scan_formula(a: Shape, u: Shape, h0: Optional[Shape] = None, reverse: bool = False,
                         backend: Optional[str] = None, *, out_shape: Any = None, **_: Any) -> int:
    return linear_scan_flops(out_shape if out_shape is not None else u)


register_flop_formula(torch.ops.gradshard.linear_scan)(_linear_scan_formula)
