"""State-space duality (Mamba-2's SSD) in block form, as differentiable torch ops.

Per batch and head, with a scalar log-decay ``z_t <= 0`` per step::

    h_t = exp(z_t) h_{t-1} + x_t B_t^T      (h: head_dim x d_state)
    y_t = h_t C_t

Time is cut into blocks of ``Q`` steps. Inside a block a decay matrix
``L[i, j] = exp(sum_{j<l<=i} z_l)`` (0 above the diagonal) makes ``y`` an attention
``((C B^T) * L) x``; each block adds ``sum_j exp(cs_end - cs_j) x_j B_j^T`` to the state it
hands on, and the states entering the blocks are one small scan over blocks. Everything is
matmuls and pointwise ops, so autograd differentiates it exactly (the masked exponents are
``-inf`` before ``exp``: no ``0 * inf``) and a compiler fuses it -- the form
``torch.compile`` runs for the reference PyTorch path of Mamba-2, here with an initial state
in and the final state out, which makes it one shard of an adjoint region
(:mod:`gradshard.plans.adjoint.chunked`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import accumulation_dtype

__all__ = ["ssd_chunk_scan", "segsum"]


def segsum(z: Tensor) -> Tensor:
    """``(..., Q) -> (..., Q, Q)``: ``sum_{j < l <= i} z_l`` on and below the diagonal, ``-inf`` above.

    Summed per pair (a cumsum of the masked rows), not as a difference of running sums: with
    strong decays those grow large and their difference loses the small sums' precision."""
    q = z.shape[-1]
    strict = torch.ones(q, q, dtype=torch.bool, device=z.device).tril(-1)
    sums = z[..., None].expand(*z.shape, q).masked_fill(~strict, 0).cumsum(-2)
    return sums.masked_fill(~torch.ones(q, q, dtype=torch.bool, device=z.device).tril(), float("-inf"))


def ssd_chunk_scan(z: Tensor, x: Tensor, B: Tensor, C: Tensor, h0: Optional[Tensor], chunk: int,
                   C2: Optional[Tensor] = None) -> tuple[Tensor, ...]:
    """``(y, h_T)`` for ``z`` (b, T, H), ``x`` (b, T, H, P), ``B``, ``C`` (b, T, H, N) and the initial
    state ``h0`` (b, H, P, N) or None (zero). Computed in the inputs' accumulation dtype
    (float32 for half types); ``T`` need not be a multiple of ``chunk`` (padded with steps that
    neither decay nor add). ``C2`` (like ``C``): a second readout ``y2_t = h_t C2_t`` of the same
    states, returned third (the decay matrices and block states are shared)."""
    acc = accumulation_dtype(torch.promote_types(torch.promote_types(x.dtype, B.dtype), C.dtype))
    b, length, heads, p = x.shape
    n_blocks = max(1, -(-length // chunk))
    pad = n_blocks * chunk - length
    queries = [C] if C2 is None else [C, C2]
    z, x, B, *queries = (t.to(acc) for t in (z, x, B, *queries))
    if pad:
        z, x, B, *queries = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (z, x, B, *queries))
    zc = z.reshape(b, n_blocks, chunk, heads).permute(0, 3, 1, 2)  # (b, H, blocks, Q)
    xc, Bc = (t.reshape(b, n_blocks, chunk, heads, -1) for t in (x, B))
    cs = zc.cumsum(-1)
    decays = torch.exp(segsum(zc))
    added = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bc, torch.exp(cs[..., -1:] - cs), xc)
    first = added.new_zeros((b, 1, heads, p, added.shape[-1])) if h0 is None else h0.to(acc)[:, None]
    carried = torch.einsum("bhzc,bchpn->bzhpn", torch.exp(segsum(F.pad(cs[..., -1], (1, 0)))),
                           torch.cat([first, added], 1))
    entering, final = carried[:, :-1], carried[:, -1]
    ys = []
    for q in queries:
        Cc = q.reshape(b, n_blocks, chunk, heads, -1)
        within = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cc, Bc, decays, xc)
        y = within + torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, entering, torch.exp(cs))
        ys.append(y.reshape(b, n_blocks * chunk, heads, p)[:, :length])
    return (ys[0], final) if C2 is None else (ys[0], final, ys[1])
