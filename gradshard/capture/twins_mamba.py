"""Mamba's scan kernels written with ``gradshard.kernels.linear_scan`` (traceable).

* :func:`selective_scan_reference` for Mamba-1's ``selective_scan_fn`` (CUDA extension);
* :func:`mamba_inner_reference` for ``mamba_inner_fn``, the fused path mamba_ssm's ``Mamba``
  trains with by default (``use_fast_path=True``): causal conv1d + SiLU, ``x_proj``, ``dt_proj``,
  the selective scan, output projection;
* :func:`mamba_chunk_scan_reference` for Mamba-2's ``mamba_chunk_scan_combined`` (the SSD
  Triton kernels): the same state space model, ``h_t = exp(dt_t A_h) h_{t-1} + dt_t x_t B_t^T``
  per head, ``y_t = h_t C_t`` -- computed as one scan instead of SSD's chunked
  ``exp(segsum(A))`` matrices, which is what the adjoint plan shards;
* :func:`mamba_split_conv1d_scan_reference` for ``mamba_split_conv1d_scan_combined``, the fused
  path mamba_ssm's ``Mamba2`` trains with by default (``use_mem_eff_path=True``): split of the
  input projection, causal conv1d + SiLU, the scan above, gated RMSNorm (per group), SwiGLU of the
  optional non-SSM channels, output projection.

mamba_ssm's ``selective_scan_fn`` calls a CUDA extension that no front door can trace.
:func:`selective_scan_reference` computes the same function (mamba's ``selective_scan_ref``
semantics) with a gradshard scan, so a captured Mamba block shows one ``linear_scan`` and
gets an adjoint region like any other layer. The python, fx and dynamo front doors swap it in
automatically while capturing (:mod:`gradshard.capture.substitutions`);
:func:`gradshard.capture.substitutions.install_traceable_twins` swaps them in for good, for
``torch.compile(backend=gs.backend(...))`` where Dynamo traces the model before gradshard sees it.

Tested against a per-step loop of the same equations and, through capture, against a
stand-in mamba_ssm package (``tests/adjoint``); not against mamba_ssm itself (it needs CUDA
and is not installed here).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["selective_scan_reference", "mamba_inner_reference", "mamba_chunk_scan_reference", "mamba_split_conv1d_scan_reference",
           "patch_mamba_selective_scan"]


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


def _causal_depthwise_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str]) -> Tensor:
    """``causal_conv1d_fn(x, weight, bias, activation)``: x (batch, dim, L), weight (dim, width)."""
    width = weight.shape[-1]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])[..., : x.shape[-1]]
    return F.silu(out) if activation in ("silu", "swish") else out


def mamba_inner_reference(xz: Tensor, conv1d_weight: Tensor, conv1d_bias: Optional[Tensor], x_proj_weight: Tensor,
                          delta_proj_weight: Tensor, out_proj_weight: Tensor, out_proj_bias: Optional[Tensor],
                          A: Tensor, B: Optional[Tensor] = None, C: Optional[Tensor] = None,
                          D: Optional[Tensor] = None, delta_bias: Optional[Tensor] = None,
                          B_proj_bias: Optional[Tensor] = None, C_proj_bias: Optional[Tensor] = None,
                          delta_softplus: bool = True, checkpoint_lvl: int = 1,
                          b_rms_weight: Optional[Tensor] = None, c_rms_weight: Optional[Tensor] = None,
                          dt_rms_weight: Optional[Tensor] = None, b_c_dt_rms_eps: float = 1e-6) -> Tensor:
    """mamba_ssm's ``mamba_inner_fn`` (same arguments; ``checkpoint_lvl`` only picks what it stores).

    ``xz``: (batch, 2 * d_inner, L); ``conv1d_weight``: (d_inner, 1, width); ``x_proj_weight``:
    (dt_rank + 2 * d_state, d_inner); ``delta_proj_weight``: (d_inner, dt_rank); ``A``: (d_inner, d_state).
    """
    if any(w is not None for w in (b_rms_weight, c_rms_weight, dt_rms_weight)):
        raise NotImplementedError("gradshard's twin of mamba_inner_fn does not support the B/C/dt RMSNorm weights; "
                                  "use plan='none' with mamba_ssm's kernel for this model")
    if A.is_complex():
        raise NotImplementedError("mamba_inner_reference: complex A is not supported")
    rank, d_state = delta_proj_weight.shape[1], A.shape[-1]
    x, z = xz.chunk(2, dim=1)
    x = _causal_depthwise_conv(x, conv1d_weight.flatten(1), conv1d_bias, "silu")
    x_dbl = F.linear(x.transpose(1, 2), x_proj_weight)  # (batch, L, rank + 2 * d_state)
    delta = F.linear(x_dbl[..., :rank], delta_proj_weight).transpose(1, 2)  # (batch, d_inner, L)
    if B is None:
        B = x_dbl[..., rank:rank + d_state]
        B = (B if B_proj_bias is None else B + B_proj_bias.to(B.dtype)).transpose(1, 2)
    if C is None:
        C = x_dbl[..., -d_state:]
        C = (C if C_proj_bias is None else C + C_proj_bias.to(C.dtype)).transpose(1, 2)
    y = selective_scan_reference(x, delta, A, B, C, D, z=z, delta_bias=delta_bias, delta_softplus=True)
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)


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


def _gated_rms_norm(x: Tensor, weight: Tensor, z: Tensor, eps: float, group_size: int, norm_before_gate: bool) -> Tensor:
    """mamba_ssm's ``rmsnorm_fn(x, weight, None, z, eps, group_size, norm_before_gate)`` (at least float32 inside)."""
    dtype = x.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32  # (no promote_types: it would be traced)
    x, z = x.to(acc), z.to(acc)
    if not norm_before_gate:
        x = x * F.silu(z)
    xg = x.unflatten(-1, (-1, group_size))
    out = (xg * torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)).flatten(-2) * weight.to(acc)
    if norm_before_gate:
        out = out * F.silu(z)
    return out.to(dtype)


def mamba_split_conv1d_scan_reference(zxbcdt: Tensor, conv1d_weight: Tensor, conv1d_bias: Optional[Tensor],
                                      dt_bias: Tensor, A: Tensor, D: Tensor, chunk_size: int,
                                      initial_states: Optional[Tensor] = None, seq_idx: Optional[Tensor] = None,
                                      dt_limit: tuple[float, float] = (0.0, float("inf")),
                                      return_final_states: bool = False, activation: str = "silu",
                                      rmsnorm_weight: Optional[Tensor] = None, rmsnorm_eps: float = 1e-6,
                                      outproj_weight: Optional[Tensor] = None, outproj_bias: Optional[Tensor] = None,
                                      headdim: Optional[int] = None, ngroups: int = 1, norm_before_gate: bool = True):
    """mamba_ssm's ``mamba_split_conv1d_scan_combined`` (same arguments), with the scan as one linear_scan.

    ``zxbcdt``: (batch, L, 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads) with
    ``dim = nheads * headdim``; ``conv1d_weight``: (dim + 2 * ngroups * dstate, width).
    """
    if seq_idx is not None:
        raise NotImplementedError(
            "gradshard's twin of mamba_split_conv1d_scan_combined does not support packed sequences (seq_idx). "
            "Pass one sequence per batch row, or use plan='none' with mamba_ssm's kernel.")
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("mamba_split_conv1d_scan_reference: headdim is required when D is (nheads,)")
        nheads = D.shape[0]
    else:
        nheads, headdim = D.shape
    batch, seqlen, width = zxbcdt.shape
    dim = nheads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    d_nonssm = (width - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    if d_nonssm < 0 or width != 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads:
        raise ValueError(f"mamba_split_conv1d_scan_reference: zxbcdt's last dim {width} does not split into "
                         f"2*d_nonssm + 2*{dim} + 2*{ngroups}*{dstate} + {nheads}")
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    conv = _causal_depthwise_conv(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, activation).transpose(1, 2)
    x, B, C = torch.split(conv, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    zh = z.unflatten(-1, (nheads, headdim))
    out = mamba_chunk_scan_reference(
        x.unflatten(-1, (nheads, headdim)), dt, A, B.unflatten(-1, (ngroups, dstate)),
        C.unflatten(-1, (ngroups, dstate)), chunk_size, D=D, z=zh if rmsnorm_weight is None else None,
        dt_bias=dt_bias, initial_states=initial_states, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=return_final_states)
    out, final = out if return_final_states else (out, None)
    out = out.flatten(-2)
    if rmsnorm_weight is not None:
        out = _gated_rms_norm(out, rmsnorm_weight, z, rmsnorm_eps, dim // ngroups, norm_before_gate)
    if d_nonssm > 0:
        a, b = zx0.chunk(2, dim=-1)
        out = torch.cat([F.silu(a) * b, out], dim=-1)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return (out, final) if return_final_states else out


def patch_mamba_selective_scan() -> bool:
    """Make mamba_ssm use :func:`selective_scan_reference` from now on; False if not installed.

    Only Mamba-1's ``selective_scan_fn``; :func:`gradshard.capture.substitutions.install_traceable_twins`
    installs every known twin (use it before ``torch.compile(backend=gs.backend(...))``).

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
