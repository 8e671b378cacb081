"""``linear_scan``: the diagonal linear recurrence, front door and backend dispatch.

The op itself (``gradshard::linear_scan``: fake, VJP, analysis rules) is defined in
:mod:`gradshard.ops.linear_scan`; this module validates arguments, picks the backend and runs
the torch or Triton kernel. Semantics: ``h_t = a_t h_{t-1} + u_t`` (``reverse``:
``h_t = a_t h_{t+1} + u_t``), ``a`` broadcasting to ``u`` = ``(batch, time, *state)``.
"""


from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .backend import runs_direct, select_backend
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


def result_dtype(a: Tensor, u: Tensor, h0: Optional[Tensor]) -> torch.dtype:
    dtype = torch.promote_types(a.dtype, u.dtype)
    return dtype if h0 is None else torch.promote_types(dtype, h0.dtype)


def run_linear_scan(a: Tensor, u: Tensor, h0: Optional[Tensor], reverse: bool, backend: Optional[str]) -> Tensor:
    """The op's body: run the chosen backend's scan (the op in :mod:`gradshard.ops.linear_scan`)."""
    which = select_backend(u, backend)
    dtype = result_dtype(a, u, h0)
    if which == "triton":
        from .triton.scan import scan_triton

        return scan_triton(a, u, h0, reverse=reverse, out_dtype=dtype)
    return scan_torch(a, u, h0, reverse=reverse, out_dtype=dtype)


def shift_coefficients(a: Tensor, length: int, reverse: bool, edge: float = 1.0) -> Tensor:
    """Coefficients of the adjoint scan: ``a_{t+1}`` (forward) or ``a_{t-1}`` (reverse), ``edge`` at the end.

    A time-broadcast ``a`` (time dim 1) is first expanded so the edge value lands only at the end.
    """
    if a.shape[1] == 1 and length > 1:
        a = a.expand(a.shape[0], length, *a.shape[2:])
    edge_t = torch.full_like(a[:, :1], edge)
    return torch.cat([edge_t, a[:, :-1]], 1) if reverse else torch.cat([a[:, 1:], edge_t], 1)


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
    if runs_direct(a, u, h0):  # what the op would run, without its dispatch
        h = run_linear_scan(a, u, h0, bool(reverse), backend)
    else:
        h = torch.ops.gradshard.linear_scan(a, u, h0, bool(reverse), backend)
    if not return_final_state:
        return h
    if u.shape[1] == 0:
        final = h0 if h0 is not None else u.new_zeros((u.shape[0], *u.shape[2:]), dtype=h.dtype)
        return h, final
    return h, (h[:, 0] if reverse else h[:, -1])
