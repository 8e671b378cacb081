"""``gradshard::dense_linear_scan``: the dense recurrence rolled dense loops lower to, with its rules.

``h_t = A_t @ h_{t-1} + u_t`` along dim 1. Registered with the op: fake, VJP (the dense
adjoint of :func:`gradshard.kernels.dense_scan.dense_adjoint_shard`), time rule (all of the
past along dim 1) and dims rule (the scan rule of :mod:`gradshard.ops.linear_scan`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from gradshard.analysis import locality
from gradshard.analysis.dims import register_dim_rule
from gradshard.kernels.dense_scan import check_dense_args, dense_adjoint_shard, dense_scan
from gradshard.ops.linear_scan import LINEAR_SCAN, Shape, scan_dims_rule

__all__ = ["DENSE_SCAN", "dense_linear_scan", "is_scan_op", "dense_linear_scan_flops"]

DENSE_SCAN = "gradshard::dense_linear_scan"


@torch.library.custom_op(DENSE_SCAN, mutates_args=())
def _dense_scan_op(A: Tensor, u: Tensor, h0: Optional[Tensor]) -> Tensor:
    """``h_t = A_t @ h_{t-1} + u_t`` (time dim 1); the op rolled dense loops lower to."""
    return dense_scan(A, u, h0)


@_dense_scan_op.register_fake
def _dense_scan_fake(A: Tensor, u: Tensor, h0: Optional[Tensor]) -> Tensor:
    shape = torch.broadcast_shapes(u.shape, (*A.shape[:-1], u.shape[-1]))
    return u.new_empty(shape, dtype=torch.promote_types(A.dtype, u.dtype))


def _dense_setup(ctx, inputs, output) -> None:
    A, u, h0 = inputs
    ctx.has_h0 = h0 is not None
    ctx.save_for_backward(A, u, h0)


def _dense_backward(ctx, grad: Tensor):
    A, u, h0 = ctx.saved_tensors
    dA, du, dh0 = dense_adjoint_shard(A, u, grad, h0, None)
    return dA, du.sum_to_size(u.shape), (dh0 if ctx.has_h0 else None)


_dense_scan_op.register_autograd(_dense_backward, setup_context=_dense_setup)


def dense_linear_scan(A: Tensor, u: Tensor, h0: Optional[Tensor] = None) -> Tensor:
    """Differentiable dense scan (``torch.ops.gradshard.dense_linear_scan``)."""
    check_dense_args(A, u)
    return torch.ops.gradshard.dense_linear_scan(A, u, h0)


def is_scan_op(node: fx.Node) -> bool:
    """Whether ``node`` calls the gradshard diagonal or dense scan op."""
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet, "_qualified_op_name", None) in (LINEAR_SCAN, DENSE_SCAN)


register_dim_rule(torch.ops.gradshard.dense_linear_scan, DENSE_SCAN)(scan_dims_rule)
locality.register_time_op(DENSE_SCAN, time_dim=1, reach=locality.ALL_PAST)


# --------------------------------------------------------------------------- FLOPs (FlopCounterMode)

def dense_linear_scan_flops(h_shape: Shape, state_size: int) -> int:
    """``h_t = A_t @ h_{t-1} + u_t`` with ``A_t`` ``n x n``: ``2 n`` per element of ``h``."""
    return 2 * math.prod(h_shape) * state_size


def _dense_scan_formula(A: Shape, u: Shape, h0: Optional[Shape] = None, *, out_shape: Any = None, **_: Any) -> int:
    return dense_linear_scan_flops(out_shape if out_shape is not None else u, A[-1])


register_flop_formula(torch.ops.gradshard.dense_linear_scan)(_dense_scan_formula)
