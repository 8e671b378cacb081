"""Dense linear recurrence ``h_t = A_t @ h_{t-1} + u_t``: sequential torch kernels.

``A`` is ``(batch, time, N, N)`` (batch/time may be 1), ``u`` ``(batch, time, N, P)``. The
adjoint is ``lam_t = g_t + A_{t+1}^T lam_{t+1}``, ``dA_t = lam_t h_{t-1}^T``. The op rolled
dense loops lower to (``gradshard::dense_linear_scan``) is defined in
:mod:`gradshard.ops.dense_scan`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["check_dense_args", "dense_scan", "dense_adjoint_shard", "step_of"]


def check_dense_args(A: Tensor, u: Tensor) -> None:
    if A.dim() != u.dim() or A.shape[-1] != A.shape[-2] or A.shape[-1] != u.shape[-2]:
        raise ValueError(
            f"dense recurrence: A must be (batch, time, N, N) and u (batch, time, N, P) with the same "
            f"number of dims; got A {tuple(A.shape)}, u {tuple(u.shape)}"
        )


def step_of(x: Tensor, t: int) -> Tensor:
    """Step ``t`` of ``x`` along dim 1 (step 0 when ``x`` is broadcast over time)."""
    return x[:, 0] if x.shape[1] == 1 else x[:, t]


def dense_scan(A: Tensor, u: Tensor, h0: Optional[Tensor] = None) -> Tensor:
    """``h_t = A_t @ h_{t-1} + u_t`` along dim 1 (sequential; O(T N^2 P))."""
    check_dense_args(A, u)
    dtype = torch.promote_types(A.dtype, u.dtype)
    shape = torch.broadcast_shapes(u.shape, (*A.shape[:-1], u.shape[-1]))
    out = torch.empty(shape, dtype=dtype, device=u.device)
    h = None if h0 is None else h0.to(dtype)
    for t in range(u.shape[1]):
        ut = step_of(u, t).to(dtype)
        h = ut.expand(out[:, t].shape) if h is None else torch.matmul(step_of(A, t).to(dtype), h) + ut
        out[:, t] = h
    return out


def dense_adjoint_shard(A: Tensor, u: Tensor, g: Tensor, h0: Optional[Tensor], carry: Optional[Tensor],
                        lam: Optional[Tensor] = None, h: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one dense shard (see the module doc); ``lam`` given: use it (truncated);
    ``h`` given: the shard's states (else recomputed)."""
    h = dense_scan(A, u, h0) if h is None else h
    if lam is None:
        lam = torch.empty_like(g, dtype=h.dtype)
        acc = carry.to(h.dtype) if carry is not None else None
        for t in range(u.shape[1] - 1, -1, -1):
            cur = g[:, t].to(h.dtype) if acc is None else g[:, t] + acc
            lam[:, t] = cur
            acc = step_of(A, t).transpose(-1, -2) @ cur
        grad_h0 = acc if acc is not None else torch.zeros_like(h[:, 0])
    else:
        grad_h0 = step_of(A, 0).transpose(-1, -2) @ lam[:, 0]
    h_prev = torch.cat([(torch.zeros_like(h[:, :1]) if h0 is None else h0.unsqueeze(1).to(h.dtype)), h[:, :-1]], 1)
    grad_A = (lam @ h_prev.transpose(-1, -2)).sum_to_size(A.shape).to(A.dtype)
    return grad_A, lam.to(u.dtype), grad_h0
