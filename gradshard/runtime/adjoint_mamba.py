"""Mamba's ``selective_scan_fn`` written with ``gradshard.kernels.linear_scan`` (traceable).

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

__all__ = ["selective_scan_reference", "patch_mamba_selective_scan"]


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
