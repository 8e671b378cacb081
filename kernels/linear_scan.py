"""``linear_scan``: the diagonal linear recurrence as one custom op with an exact adjoint backward.

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
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .backend import select_backend
from .scan_torch import scan_torch


def check_scan_args(a: Tensor, u: Tensor, h0: Optional[Tensor], where: str = "linear_scan") -> None:
    """Validate shapes/dtypes/devices of a diagonal scan; raise a ValueError saying what to change."""
    if u.dim() < 2:
        raise ValueError(f"gradshard.kernels.{where}: u must be (batch, time, *state), got shape {tuple(u.shape)}.")
    if a.dim() != u.dim():
        raise ValueError(
            f"gradshard.kernels.{where}: a must have as many dims as u (got a {tuple(a.shape)}, u "
            f"{tuple(u.shape)}); insert size-1 dims to broadcast, e.g. a[..., None, None]."
        )
    for i, (sa, su) in enumerate(zip(a.shape, u.shape)):
        if sa != su and sa != 1:
            raise ValueError(
                f"gradshard.kernels.{where}: a {tuple(a.shape)} does not broadcast to u {tuple(u.shape)} "
                f"(dim {i}: {sa} vs {su}); each dim of a must equal u's or be 1."
            )
    for name, t in (("a", a), ("u", u), ("h0", h0)):
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"gradshard.kernels.{where}: {name} must be floating point, got {t.dtype}.")
        if t is not None and t.device != u.device:
            raise ValueError(f"gradshard.kernels.{where}: {name} is on {t.device} but u is on {u.device}.")
    if h0 is not None and tuple(h0.shape) != (u.shape[0], *u.shape[2:]):
        raise ValueError(
            f"gradshard.kernels.{where}: h0 must be (batch, *state) = {(u.shape[0], *u.shape[2:])}, "
            f"got {tuple(h0.shape)}."
        )


def _result_dtype(a: Tensor, u: Tensor, h0: Optional[Tensor]) -> torch.dtype:
    dtype = torch.promote_types(a.dtype, u.dtype)
    return dtype if h0 is None else torch.promote_types(dtype, h0.dtype)


@torch.library.custom_op("gradshard::linear_scan", mutates_args=())
def _linear_scan_op(a: Tensor, u: Tensor, h0: Optional[Tensor], reverse: bool, backend: Optional[str]) -> Tensor:
    """Dispatcher-level op; see the module docstring."""
    which = select_backend(u, backend)
    dtype = _result_dtype(a, u, h0)
    if which == "triton":
        from .triton.scan import scan_triton

        return scan_triton(a, u, h0, reverse=reverse, out_dtype=dtype)
    return scan_torch(a, u, h0, reverse=reverse, out_dtype=dtype)


@_linear_scan_op.register_fake
def _linear_scan_fake(a: Tensor, u: Tensor, h0: Optional[Tensor], reverse: bool, backend: Optional[str]) -> Tensor:
    return u.new_empty(u.shape, dtype=_result_dtype(a, u, h0))


def shift_coefficients(a: Tensor, length: int, reverse: bool, edge: float = 1.0) -> Tensor:
    """Coefficients of the adjoint scan: ``a_{t+1}`` (forward) or ``a_{t-1}`` (reverse), ``edge`` at the end.

    A time-broadcast ``a`` (time dim 1) is first expanded so the edge value lands only at the end.
    """
    if a.shape[1] == 1 and length > 1:
        a = a.expand(a.shape[0], length, *a.shape[2:])
    edge_t = torch.full_like(a[:, :1], edge)
    return torch.cat([edge_t, a[:, :-1]], 1) if reverse else torch.cat([a[:, 1:], edge_t], 1)


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


def linear_scan(
    a: Tensor,
    u: Tensor,
    h0: Optional[Tensor] = None,
    *,
    reverse: bool = False,
    backend: Optional[str] = None,
    return_final_state: bool = False,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Diagonal linear recurrence over time (dim 1); differentiable in ``a``, ``u`` and ``h0``.

    ``h_t = a_t * h_{t-1} + u_t`` (``reverse=True``: ``h_t = a_t * h_{t+1} + u_t``), starting
    from ``h0`` (or zeros). Returns ``h`` shaped like ``u``; with ``return_final_state`` also the
    last state reached, ``h[:, -1]`` (``h[:, 0]`` when reversed; ``h0`` or zeros if T == 0),
    which is what the next time shard takes as its ``h0``.
    ``backend``: None (auto), "torch" or "triton" (see :mod:`gradshard.kernels.backend`).
    """
    check_scan_args(a, u, h0)
    select_backend(u, backend)  # fail early, in the caller's frame, on an impossible backend
    h = torch.ops.gradshard.linear_scan(a, u, h0, bool(reverse), backend)
    if not return_final_state:
        return h
    if u.shape[1] == 0:
        final = h0 if h0 is not None else u.new_zeros((u.shape[0], *u.shape[2:]), dtype=h.dtype)
        return h, final
    return h, (h[:, 0] if reverse else h[:, -1])
