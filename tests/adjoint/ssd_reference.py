"""Mamba-2's SSD algorithm as mamba_ssm's ``modules/ssd_minimal.py`` writes it (chunked ``segsum``).

The stand-in mamba_ssm kernels of the Mamba-2 tests compute with this, so the eager reference
is Mamba-2's own math, independent of gradshard's one-scan twins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segsum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum_{j < d <= i} x_d`` (``-inf`` above the diagonal), as in ssd_minimal.py."""
    T = x.size(-1)
    x = x[..., None].expand(*x.shape, T)
    x = x.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-1), 0)
    x_segsum = torch.cumsum(x, dim=-2)
    return x_segsum.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=0), -torch.inf)


def ssd_minimal_discrete(X, A, B, C, block_len, initial_states=None):
    """mamba_ssm's SSD reference: X (b, l, h, p) (times dt), A (b, l, h) (times dt), B, C (b, l, h, n)."""
    b, l, h, p = X.shape
    c = l // block_len
    X, A, B, C = (t.reshape(b, c, block_len, *t.shape[2:]) for t in (X, A, B, C))
    A = A.permute(0, 3, 1, 2)
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(segsum(A))
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, L, X)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, X)
    first = torch.zeros_like(states[:, :1]) if initial_states is None else initial_states[:, None]
    states = torch.cat([first, states], dim=1)
    decay_chunk = torch.exp(segsum(F.pad(A_cumsum[:, :, :, -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cumsum))
    return (Y_diag + Y_off).reshape(b, l, h, p), final_state


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                   dt_softplus=False, return_final_states=False):
    """The kernel's contract computed by SSD (T padded to a multiple of the chunk with dt = 0)."""
    T, heads = x.shape[1], x.shape[2]
    dt = dt if dt_bias is None else dt + dt_bias
    dt = F.softplus(dt) if dt_softplus else dt
    pad = -T % chunk_size
    xp, dtp, Bp, Cp = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    Bh, Ch = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (Bp, Cp))
    y, final = ssd_minimal_discrete(xp * dtp[..., None], A * dtp, Bh, Ch, chunk_size, initial_states)
    y = y[:, :T]
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    return (y, final) if return_final_states else y
