"""``adjoint_shard``: gradients of one time shard of ``h_t = a_t h_{t-1} + u_t`` without stored states.

For a shard ``t = 1..S`` that starts from ``h0`` and receives the gradient ``g_t = dL/dh_t``
reaching each of its states directly, plus the carry ``lam_carry = a_{S+1} lam_{S+1}`` from the
next shard (zero for the last shard)::

    h_t   = a_t h_{t-1} + u_t                      (recomputed from h0, never stored by Triton)
    lam_S = g_S + lam_carry,   lam_t = g_t + a_{t+1} lam_{t+1}
    grad_a_t = lam_t h_{t-1},  grad_u_t = lam_t,  grad_h0 = a_1 lam_1

``grad_h0`` is exactly the ``lam_carry`` of the previous shard, so shards chain right to left:
``carry = adjoint_shard(a_k, u_k, g_k, h0_k, carry)[2]`` for k = K..1 (docs/DESIGN.md, "adjoint").
Shapes follow :func:`gradshard.kernels.linear_scan`: ``a`` broadcasts to ``u`` =
``(batch, S, *state)``; ``g`` is like ``u``; ``h0`` and ``lam_carry`` are ``(batch, *state)``.
This op is a building block of the backward pass itself and is not differentiable.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .backend import accumulation_dtype, runs_direct, select_backend
from .linear_scan import check_scan_args, shift_coefficients
from .scan_torch import scan_torch


def shard_dtypes(a: Tensor, u: Tensor, g: Tensor, h0: Optional[Tensor]) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """Output dtypes (grad_a, grad_u, grad_h0)."""
    state = torch.promote_types(torch.promote_types(a.dtype, u.dtype), g.dtype)
    return a.dtype, u.dtype, state if h0 is None else h0.dtype


def adjoint_shard_torch(
    a: Tensor, u: Tensor, g: Tensor, h0: Optional[Tensor], lam_carry: Optional[Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """Torch reference: two exact chunked scans (forward for h, reverse for lam), then products."""
    da_t, du_t, dh_t = shard_dtypes(a, u, g, h0)
    acc = accumulation_dtype(torch.promote_types(torch.promote_types(a.dtype, u.dtype), g.dtype))
    length = u.shape[1]
    if length == 0:
        zero = torch.zeros((u.shape[0], *u.shape[2:]), dtype=dh_t, device=u.device)
        return torch.zeros(a.shape, dtype=da_t, device=u.device), torch.zeros_like(u), zero
    h = scan_torch(a, u, h0, reverse=False)
    lam = scan_torch(shift_coefficients(a, length, reverse=False, edge=1.0), g, lam_carry, reverse=True)
    edge = torch.zeros_like(h[:, :1]) if h0 is None else h0.to(acc).unsqueeze(1)
    h_prev = torch.cat([edge, h[:, :-1]], 1)
    grad_a = (lam * h_prev).sum_to_size(a.shape).to(da_t)
    grad_h0 = (a[:, 0].to(acc) * lam[:, 0]).to(dh_t)
    return grad_a, lam.to(du_t), grad_h0


def run_adjoint_shard(a: Tensor, u: Tensor, g: Tensor, h0: Optional[Tensor], lam_carry: Optional[Tensor],
                      backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    """The op's body (op: :mod:`gradshard.ops.adjoint_shard`): run the chosen backend."""
    if select_backend(u, backend) == "triton":
        from .triton.adjoint import adjoint_shard_triton

        return adjoint_shard_triton(a, u, g, h0, lam_carry, out_dtypes=shard_dtypes(a, u, g, h0))
    return adjoint_shard_torch(a, u, g, h0, lam_carry)


def adjoint_shard(
    a: Tensor,
    u: Tensor,
    g: Tensor,
    h0: Optional[Tensor] = None,
    lam_carry: Optional[Tensor] = None,
    *,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``(grad_a, grad_u, grad_h0)`` for one shard; ``grad_h0`` is the previous shard's carry.

    ``grad_a`` has ``a``'s shape (summed over broadcast dims), ``grad_u`` ``u``'s, ``grad_h0``
    is ``(batch, *state)`` (returned even without ``h0``: it is the carry to pass on).
    """
    check_scan_args(a, u, h0, where="adjoint_shard")
    if tuple(g.shape) != tuple(u.shape):
        raise ValueError(f"gradshard.kernels.adjoint_shard: g must be shaped like u {tuple(u.shape)}, got {tuple(g.shape)}.")
    if lam_carry is not None and tuple(lam_carry.shape) != (u.shape[0], *u.shape[2:]):
        raise ValueError(
            f"gradshard.kernels.adjoint_shard: lam_carry must be (batch, *state) = "
            f"{(u.shape[0], *u.shape[2:])}, got {tuple(lam_carry.shape)}."
        )
    for name, t in (("g", g), ("lam_carry", lam_carry)):
        if t is not None and t.device != u.device:
            raise ValueError(f"gradshard.kernels.adjoint_shard: {name} is on {t.device} but u is on {u.device}.")
    select_backend(u, backend)
    if runs_direct(a, u, g, h0, lam_carry):  # what the op would run, without its dispatch
        return run_adjoint_shard(a, u, g, h0, lam_carry, backend)
    return torch.ops.gradshard.adjoint_shard(a, u, g, h0, lam_carry, backend)
