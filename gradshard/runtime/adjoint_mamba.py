"""Mamba's scan kernels written with ``gradshard.kernels.linear_scan`` (traceable).

* :func:`selective_scan_reference` for Mamba-1's ``selective_scan_fn`` (CUDA extension);
* :func:`mamba_chunk_scan_reference` for Mamba-2's ``mamba_chunk_scan_combined`` (the SSD
  Triton kernels): the same state space model, ``h_t = exp(dt_t A_h) h_{t-1} + dt_t x_t B_t^T``
  per head, ``y_t = h_t C_t`` -- computed as one scan instead of SSD's chunked
  ``exp(segsum(A))`` matrices, which is what the adjoint plan shards.

mamba_ssm's ``selective_scan_fn`` calls a CUDA extension that no front door can trace.
:func:`selective_scan_reference` computes the same function (mamba's ``selective_scan_ref``
semantics) with a gradshard scan, so a captured Mamba block shows one ``linear_scan`` and
gets an adjoint region like any other layer. The python, fx and dynamo front doors swap it in
automatically while capturing (:mod:`gradshard.substitutions`);
:func:`patch_mamba_selective_scan` swaps it in for good, for ``torch.compile(backend=gs.backend(...))``
where Dynamo traces the model before gradshard sees it.

Tested against a per-step loop of the same equations and, through capture, against a
stand-in mamba_ssm package (``tests/adjoint``); not against mamba_ssm itself (it needs CUDA
and is not installed here).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["selective_scan_reference", "mamba_chunk_scan_reference", "patch_mamba_selective_scan"]


def _expand_groups(x: Tensor, d: int) -> Tensor:
    """(B, G, N, L) -> (B, D, N, L) (grouped B/C, as in Mamba-2 style selective scans)."""
    return x.repeat_interleave(d // x.shape[1], dim=1)


def selective_scan_reference(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor] = None,
                             z: Optional[Tensor] = None, delta_bias: Optional[Tensor] = None,
                             delta_softplus: bool = False, return_last_state: bool = False):
    """``h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t``, ``y_t = C_t h_t + D u_t`` (times ``silu(z)``).

    Shapes as in mamba_ssm: ``u, delta, z``: (batch, dim, L); ``A``: (dim, N) real;
    ``B, C``: (dim, N), (batch, N, L) or (batch, groups, N, L); ``D, delta_bias``: (dim,).
    """
    from gradshard.kernels import linear_scan

    if A.is_complex():
        raise NotImplementedError("selective_scan_reference: complex A is not supported")
    dt = delta.float() if delta.dtype in (torch.float16, torch.bfloat16) else delta
    if delta_bias is not None:
        dt = dt + delta_bias[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    dim = u.shape[1]
    dA = torch.exp(torch.einsum("bdl,dn->bldn", dt, A))
    if B.dim() == 2:
        Bu = torch.einsum("bdl,dn,bdl->bldn", dt, B, u)
    elif B.dim() == 3:
        Bu = torch.einsum("bdl,bnl,bdl->bldn", dt, B, u)
    else:
        Bu = torch.einsum("bdl,bdnl,bdl->bldn", dt, _expand_groups(B, dim), u)
    h = linear_scan(dA, Bu)  # (batch, L, dim, N)
    if C.dim() == 2:
        y = torch.einsum("bldn,dn->bdl", h, C)
    elif C.dim() == 3:
        y = torch.einsum("bldn,bnl->bdl", h, C)
    else:
        y = torch.einsum("bldn,bdnl->bdl", h, _expand_groups(C, dim))
    out = y if D is None else y + u * D[:, None]
    if z is not None:
        out = out * F.silu(z)
    out = out.to(u.dtype)
    return (out, h[:, -1]) if return_last_state else out


def mamba_chunk_scan_reference(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                               D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                               dt_bias: Optional[Tensor] = None, initial_states: Optional[Tensor] = None,
                               seq_idx: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None,
                               dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
                               return_final_states: bool = False, return_varlen_states: bool = False):
    """mamba_ssm's ``mamba_chunk_scan_combined`` (same arguments) as one diagonal scan per head.

    Shapes as in mamba_ssm: ``x, z``: (batch, L, heads, headdim); ``dt``: (batch, L, heads);
    ``A, dt_bias``: (heads,); ``B, C``: (batch, L, groups, dstate); ``D``: (heads, headdim) or
    (heads,); ``initial_states`` and the final state: (batch, heads, headdim, dstate).
    ``chunk_size`` only chooses SSD's blocking, which does not change the result.
    """
    from gradshard.kernels import linear_scan

    if seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError(
            "gradshard's twin of mamba_chunk_scan_combined does not support packed sequences (seq_idx / "
            "cu_seqlens / return_varlen_states): the state must be reset at sequence starts. Pass one "
            "sequence per batch row, or use plan='none' with mamba_ssm's kernel.")
    heads, groups = x.shape[2], B.shape[2]
    if heads % groups:
        raise ValueError(f"mamba_chunk_scan_reference: {heads} heads are not a multiple of {groups} B/C groups")
    dt = dt.float() if dt.dtype in (torch.float16, torch.bfloat16) else dt
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)  # the kernel's `dt if dt > 20 else log1p(exp(dt))`: softplus's threshold
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    Bh = B.repeat_interleave(heads // groups, dim=2).to(dt.dtype)
    Ch = C.repeat_interleave(heads // groups, dim=2).to(dt.dtype)
    xs = x.to(dt.dtype)
    a = torch.exp(dt * A.to(dt.dtype))[..., None, None]  # (batch, L, heads, 1, 1)
    u = (dt[..., None] * xs)[..., :, None] * Bh[..., None, :]  # (batch, L, heads, headdim, dstate)
    h0 = None if initial_states is None else initial_states.to(dt.dtype)
    states = linear_scan(a, u, h0)
    y = torch.einsum("blhpn,blhn->blhp", states, Ch)
    if D is not None:
        y = y + xs * (D[:, None] if D.dim() == 1 else D).to(dt.dtype)
    if z is not None:
        y = y * F.silu(z.to(dt.dtype))
    y = y.to(x.dtype)
    return (y, states[:, -1]) if return_final_states else y


def patch_mamba_selective_scan() -> bool:
    """Make mamba_ssm use :func:`selective_scan_reference` from now on; False if not installed.

    Not tested against the real package (see the module docstring)."""
    try:
        import mamba_ssm.ops.selective_scan_interface as ssi  # type: ignore[import-not-found]
    except ImportError:
        return False
    ssi.selective_scan_fn = selective_scan_reference
    try:
        import mamba_ssm.modules.mamba_simple as simple  # type: ignore[import-not-found]

        simple.selective_scan_fn = selective_scan_reference
    except ImportError:
        pass
    return True
