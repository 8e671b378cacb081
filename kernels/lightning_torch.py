"""Torch reference of block-wise ("lightning") linear attention with per-step decay, fwd and bwd.

Recurrence (per batch and head; ``S`` is ``dk x dv``, ``q_t, k_t`` rows of length dk)::

    S_t = d_t S_{t-1} + k_t^T v_t,    o_t = q_t S_t,    S_0 = initial_state (or 0)

Within a chunk (local positions ``i, j``; ``S_c`` the state entering the chunk) everything
is expressed with three division-free, log-free decay factors built by cumulative products::

    M[i, j]  = prod_{j < l <= i} d_l   (i >= j, else 0)      intra-chunk decay mask
    P[i]     = prod_{l <= i} d_l                              decay from the chunk start
    Gam[j]   = M[C-1, j]                                      decay to the chunk end

    O      = ((Q K^T) * M) V + (P * Q) S_c
    S_next = P[C-1] S_c + (Gam * K)^T V

Backward, with ``Gx`` the gradient reaching the chunk's end state from later chunks
(``dS_final`` for the last one; itself one reverse scan over chunks)::

    dQ = ((dO V^T) * M) K + (P * dO) S_c^T
    dK = ((V dO^T) * M^T) Q + Gam * (V Gx^T)
    dV = ((K Q^T) * M^T) dO + Gam * (K Gx)
    dd_t = <G_t, S_{t-1}> = Pp * (M^T w) + Pp * Gam * <Gx, S_c> + Gam * (Ms z)
           + colsum(M * ((Q K^T * dO V^T) Ms^T))

where ``Ms[i, j] = M[i-1, j]`` (j < i), ``Pp[i] = P[i-1]`` (``Pp[0] = 1``),
``w_s = q_s S_c do_s^T`` and ``z_j = k_j Gx v_j^T``. The last term is one extra ``C x C x C``
matmul per chunk and keeps ``dd`` exact for any decay (no ``dlog d / d`` division).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
import torch.nn.functional as F

from .scan_torch import scan_torch


def _chunked(x: Tensor, chunk: int, fill: float = 0.0) -> Tensor:
    """(B, H, T, *r) -> (B, H, n, C, *r), padding time with ``fill``."""
    length = x.shape[2]
    n = max(1, -(-length // chunk))
    pad = n * chunk - length
    if pad:
        x = torch.cat([x, x.new_full((*x.shape[:2], pad, *x.shape[3:]), fill)], 2)
    return x.reshape(*x.shape[:2], n, chunk, *x.shape[3:])


def _unchunk(x: Tensor, length: int) -> Tensor:
    """(B, H, n, C, *r) -> (B, H, T, *r)."""
    return x.reshape(*x.shape[:2], -1, *x.shape[4:])[:, :, :length]


def decay_factors(d: Optional[Tensor], chunk: int, like: Tensor) -> dict[str, Tensor]:
    """M, Ms, P, Pp, Gam, Pe for chunked per-step decays ``d`` (B, H, n, C), or for no decay."""
    idx = torch.arange(chunk, device=like.device)
    lower = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    if d is None:
        one = torch.ones((1, 1, 1, chunk), dtype=like.dtype, device=like.device)
        m = lower.to(like.dtype).expand(1, 1, 1, chunk, chunk)
        return {"M": m, "Ms": strict.to(like.dtype).expand(1, 1, 1, chunk, chunk), "P": one, "Pp": one,
                "Gam": one, "Pe": one[..., 0]}
    d_prev = F.pad(d[..., :-1], (1, 0), value=1.0)
    m = torch.cumprod(torch.where(strict, d[..., :, None], torch.ones_like(d[..., :, None])), dim=-2)
    m = m * lower
    ms = torch.cumprod(torch.where(idx[:, None] > idx[None, :] + 1, d_prev[..., :, None],
                                   torch.ones_like(d_prev[..., :, None])), dim=-2) * strict
    p = torch.cumprod(d, dim=-1)
    return {"M": m, "Ms": ms, "P": p, "Pp": torch.cumprod(d_prev, dim=-1), "Gam": m[..., -1, :],
            "Pe": p[..., -1]}


def _chunk_states(u: Tensor, pe: Tensor, s0: Optional[Tensor], reverse: bool = False) -> Tensor:
    """Scan ``S <- Pe_c S + U_c`` over chunks; returns the state after each chunk (B, H, n, dk, dv)."""
    b, h, n = u.shape[:3]
    flat = u.reshape(b * h, n, *u.shape[3:])
    a = pe.expand(b, h, n).reshape(b * h, n, 1, 1)
    h0 = None if s0 is None else s0.reshape(b * h, *u.shape[3:])
    return scan_torch(a, flat, h0, reverse=reverse).reshape(u.shape)


def _prepare(q, k, v, decay, chunk, acc):
    length = q.shape[2]
    qc, kc, vc = (_chunked(x.to(acc), chunk) for x in (q, k, v))
    dc = None if decay is None else _chunked(decay.to(acc), chunk, fill=1.0)
    return length, qc, kc, vc, decay_factors(dc, chunk, qc)


def _states_before(u: Tensor, f: dict, s0: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """States entering each chunk and the final state."""
    after = _chunk_states(u, f["Pe"].expand(u.shape[:3]), s0)
    first = torch.zeros_like(after[:, :, :1]) if s0 is None else s0.unsqueeze(2).to(after.dtype)
    return torch.cat([first, after[:, :, :-1]], 2), after[:, :, -1]


def lightning_fwd_torch(q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor], s0: Optional[Tensor],
                        chunk: int, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """Forward. ``decay`` is None or per step (B, H, T) (broadcast views allowed). Returns (o, S_T) in ``acc``."""
    length, qc, kc, vc, f = _prepare(q, k, v, decay, chunk, acc)
    u = (kc * f["Gam"][..., None]).transpose(-1, -2) @ vc
    before, final = _states_before(u, f, s0)
    o = ((qc @ kc.transpose(-1, -2)) * f["M"]) @ vc + (qc * f["P"][..., None]) @ before
    return _unchunk(o, length), final


def lightning_bwd_torch(q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor], s0: Optional[Tensor],
                        do: Tensor, ds: Optional[Tensor], chunk: int, acc: torch.dtype):
    """Backward. Returns (dq, dk, dv, dd per step (B, H, T) or None, dS0) in ``acc``."""
    length, qc, kc, vc, f = _prepare(q, k, v, decay, chunk, acc)
    doc = _chunked(do.to(acc), chunk)
    m, gam, p = f["M"], f["Gam"][..., None], f["P"][..., None]
    u = (kc * gam).transpose(-1, -2) @ vc
    before, _ = _states_before(u, f, s0)
    # Gradient carried into each chunk's end state: R_c = Pe_c R_{c+1} + (P Q_c)^T dO_c, R_n = dS.
    w_in = (qc * p).transpose(-1, -2) @ doc
    rev = _chunk_states(w_in, f["Pe"].expand(w_in.shape[:3]), ds, reverse=True)
    last = torch.zeros_like(rev[:, :, :1]) if ds is None else ds.unsqueeze(2).to(acc)
    gx = torch.cat([rev[:, :, 1:], last], 2)
    ds0 = rev[:, :, 0]
    qk = qc @ kc.transpose(-1, -2)
    dov = doc @ vc.transpose(-1, -2)
    dq = (dov * m) @ kc + (doc * p) @ before.transpose(-1, -2)
    dk = (dov * m).transpose(-1, -2) @ qc + gam * (vc @ gx.transpose(-1, -2))
    dv = (qk * m).transpose(-1, -2) @ doc + gam * (kc @ gx)
    dd = None
    if decay is not None:
        ms, pp, g1 = f["Ms"], f["Pp"], f["Gam"]
        w = ((qc @ before) * doc).sum(-1)
        z = ((kc @ gx) * vc).sum(-1)
        t1 = pp * (m * w[..., :, None]).sum(-2)
        t2 = pp * g1 * (gx * before).sum((-1, -2))[..., None]
        t3 = g1 * (ms @ z[..., None])[..., 0]
        t4 = (m * ((qk * dov) @ ms.transpose(-1, -2))).sum(-2)
        dd = _unchunk(t1 + t2 + t3 + t4, length)
    return _unchunk(dq, length), _unchunk(dk, length), _unchunk(dv, length), dd, ds0


def lightning_naive(q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor], s0: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Per-step recurrence (the definition); differentiable, for tests. decay None/(H,)/(B,H,T)."""
    b, h, length, dk = q.shape
    state = q.new_zeros(b, h, dk, v.shape[-1]) if s0 is None else s0
    outs = []
    for t in range(length):
        if decay is not None:
            dt = decay.view(1, h, 1, 1) if decay.dim() == 1 else decay[:, :, t, None, None]
            state = dt * state
        state = state + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, None, :] @ state)[:, :, 0])
    o = torch.stack(outs, 2) if outs else v.new_zeros(b, h, 0, v.shape[-1])
    return o, state
