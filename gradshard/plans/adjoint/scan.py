"""Recurrence math for the adjoint plans: forward scans and per-shard adjoint sweeps.

Two recurrence kinds, both in the canonical layout ``(batch, time, *state)``:

* :class:`DiagonalRecurrence` -- ``h_t = a_t * h_{t-1} + u_t``; ``a`` broadcasts to ``u``
  (any dim may be 1: scalar per head, shared over the batch, constant over time) or is
  ``None`` (``a = 1``: a cumulative sum). Runs on :func:`gradshard.kernels.linear_scan` and
  :func:`gradshard.kernels.adjoint_shard`.
* :class:`DenseRecurrence` -- ``h_t = A_t @ h_{t-1} + u_t`` with ``A`` ``(batch, time, N, N)``
  (batch/time may be 1) and ``u`` ``(batch, time, N, P)``. The adjoint is
  ``lam_t = g_t + A_{t+1}^T lam_{t+1}``, ``dA_t = lam_t h_{t-1}^T`` (kernels:
  :mod:`gradshard.kernels.dense_scan`).

Shard convention (both kinds, the one of ``adjoint_shard``): a shard starts from ``h0``
(``None``: zeros) and receives ``carry = A_{S+1}^T lam_{S+1}`` from the shard after it; it
returns ``(grad_a, grad_u, grad_h0)`` where ``grad_h0`` is the carry of the shard before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from gradshard.kernels.dense_scan import dense_adjoint_shard, dense_scan, step_of

__all__ = [
    "DiagonalRecurrence",
    "DenseRecurrence",
    "recurrence_for",
]


# --------------------------------------------------------------------------- recurrence kinds


def _sum_of_products(lam: Tensor, h: Tensor, h0: Optional[Tensor], shape: tuple[int, ...]) -> Tensor:
    """``sum_to_size(lam_t * h_{t-1}, shape)`` with ``h_{-1} = h0`` (``None``: zeros).

    A coefficient shared over state dims (a scalar per head) gets its gradient as a contraction
    (``einsum``: batched dot products), so no product as large as the states is materialised.
    """
    L = lam.shape[1]
    reduced = [i for i in range(2, lam.dim()) if shape[i] == 1 and lam.shape[i] != 1]
    if reduced and shape[1] == L and L:
        dims = "abcdefghijklmnopqrstuvwxyz"[:lam.dim()]
        spec = f"{dims},{dims}->" + "".join(c for i, c in enumerate(dims) if i not in reduced)
        rest = torch.einsum(spec, lam[:, 1:], h[:, :-1])
        first = (rest.new_zeros((rest.shape[0], 1, *rest.shape[2:])) if h0 is None
                 else torch.einsum(spec, lam[:, :1], h0.unsqueeze(1).to(lam.dtype)))
        return torch.cat([first, rest], 1).reshape([1 if i in reduced else n for i, n in enumerate(lam.shape)]
                                                  ).sum_to_size(shape)
    prod = torch.empty_like(lam)
    if L > 1:
        torch.mul(lam[:, 1:], h[:, :-1], out=prod[:, 1:])
    if L:
        if h0 is None:
            prod[:, 0].zero_()
        else:
            torch.mul(lam[:, 0], h0.to(lam.dtype), out=prod[:, 0])
    return prod.sum_to_size(shape)


@dataclass(frozen=True)
class DiagonalRecurrence:
    """``h_t = a_t * h_{t-1} + u_t`` (``a`` broadcast to ``u``; ``None`` means 1)."""

    kind: str = "diagonal"

    def coeff(self, a: Optional[Tensor], u: Tensor) -> Tensor:
        if a is not None:
            return a
        return torch.ones((1,) * u.dim(), dtype=u.dtype, device=u.device)

    def scan(self, a: Optional[Tensor], u: Tensor, h0: Optional[Tensor], backend: Optional[str] = None) -> Tensor:
        from gradshard.kernels import linear_scan

        a = self.coeff(a, u)
        if h0 is not None and h0.dtype != u.dtype:
            h0 = h0.to(u.dtype)
        return linear_scan(a, u, h0, backend=backend)

    def adjoint_shard(self, a: Optional[Tensor], u: Tensor, g: Tensor, h0: Optional[Tensor],
                      carry: Optional[Tensor], backend: Optional[str] = None,
                      h: Optional[Tensor] = None) -> tuple[Optional[Tensor], Tensor, Tensor]:
        """``(grad_a, grad_u, grad_h0)``; with the shard's states ``h`` given (the runtime has them
        for the readout) one reverse ``linear_scan`` suffices, else the fused ``adjoint_shard``."""
        from gradshard.kernels import adjoint_shard, linear_scan
        from gradshard.kernels.linear_scan import shift_coefficients

        a_ = self.coeff(a, u)
        g = g.to(u.dtype)
        if h is None:
            da, du, dh0 = adjoint_shard(a_, u, g, h0, carry, backend=backend)
            return (da if a is not None else None), du, dh0
        lam = linear_scan(shift_coefficients(a_, u.shape[1], reverse=False, edge=1.0), g,
                          None if carry is None else carry.to(g.dtype), reverse=True, backend=backend)
        return self.grads_from_lam(a, h, h0, lam)

    def grads_from_lam(self, a: Optional[Tensor], h: Tensor, h0: Optional[Tensor], lam: Tensor,
                       ) -> tuple[Optional[Tensor], Tensor, Tensor]:
        """``(grad_a, grad_u, grad_h0)`` for a given adjoint ``lam`` (no copy of ``h`` shifted)."""
        da = None if a is None else _sum_of_products(lam, h, h0, tuple(a.shape)).to(a.dtype)
        a0 = self.coeff(a, lam)
        dh0 = (a0[:, 0] * lam[:, 0]).sum_to_size(lam[:, 0].shape) if lam.shape[1] else torch.zeros_like(h[:, 0])
        return da, lam, dh0

    def transpose_apply(self, a_t: Tensor, lam: Tensor) -> Tensor:
        return a_t * lam


@dataclass(frozen=True)
class DenseRecurrence:
    """``h_t = A_t @ h_{t-1} + u_t`` with ``A`` ``(batch, time, N, N)``."""

    kind: str = "dense"

    def scan(self, a: Tensor, u: Tensor, h0: Optional[Tensor], backend: Optional[str] = None) -> Tensor:
        return dense_scan(a, u, h0)

    def adjoint_shard(self, a: Tensor, u: Tensor, g: Tensor, h0: Optional[Tensor],
                      carry: Optional[Tensor], backend: Optional[str] = None,
                      h: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        return dense_adjoint_shard(a, u, g, h0, carry, h=h)

    def grads_from_lam(self, a: Tensor, h: Tensor, h0: Optional[Tensor], lam: Tensor,
                       ) -> tuple[Tensor, Tensor, Tensor]:
        h_prev = torch.cat([(torch.zeros_like(h[:, :1]) if h0 is None else h0.unsqueeze(1).to(h.dtype)), h[:, :-1]], 1)
        dA = (lam @ h_prev.transpose(-1, -2)).sum_to_size(a.shape).to(a.dtype)
        dh0 = step_of(a, 0).transpose(-1, -2) @ lam[:, 0]
        return dA, lam, dh0

    def transpose_apply(self, a_t: Tensor, lam: Tensor) -> Tensor:
        return a_t.transpose(-1, -2) @ lam


def recurrence_for(kind: str) -> DiagonalRecurrence | DenseRecurrence:
    """The recurrence object for ``kind`` (``"diagonal"`` or ``"dense"``)."""
    if kind == "dense":
        return DenseRecurrence()
    if kind == "diagonal":
        return DiagonalRecurrence()
    raise ValueError(f"unknown recurrence kind {kind!r}")
