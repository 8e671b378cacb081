"""Triton lightning attention: forward and backward, intra- and inter-chunk fused, state in and out.

Formulas: :mod:`gradshard.kernels.lightning_torch` (same notation: M, Ms, P, Pp, Gam, Pe).
The decay factors are built in registers by cumulative products (``tl.cumprod``), never by
dividing or by exponentiating log-decay differences.

* forward: grid (B*H, dv blocks). Each program walks its chunks left to right, keeping its
  ``dk x BLOCK_V`` slice of the state in registers (columns of the state are independent);
  it writes ``o`` and the final state.
* backward: grid (B*H,). Loop 1 walks chunks left to right, saves the state entering each chunk
  to a scratch buffer (``T / C`` states) and writes ``dq``; loop 2 walks them right to left with
  the carried state gradient ``Gx`` (seeded with ``d final_state``) and writes ``dk``, ``dv``
  and the per-step decay gradient; ``Gx`` at the end is ``d initial_state``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .layout import INTERPRETED, check_device, dot_precision, pow2, serialized_launch, tl_dtype


@triton.jit
def _decay_factors(D, d_off, t, sd_t, tmask, offs_c, HAS_DECAY: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr):
    """(M, P, Gam, Pe) of one chunk; padding positions decay by 1."""
    i = offs_c[:, None]
    j = offs_c[None, :]
    if HAS_DECAY:
        d = tl.load(D + d_off + t * sd_t, mask=tmask, other=1.0).to(ACC)
    else:
        d = tl.full([BC], 1.0, ACC)
    m = tl.cumprod(tl.where(i > j, d[:, None], 1.0).to(ACC), axis=0)
    m = tl.where(i >= j, m, 0.0)
    p = tl.cumprod(d, axis=0)
    gam = tl.sum(tl.where(i == BC - 1, m, 0.0), axis=0)
    pe = tl.sum(tl.where(offs_c == BC - 1, p, 0.0), axis=0)
    return m, p, gam, pe


@triton.jit
def _shifted_factors(D, d_off, t, sd_t, tmask, offs_c, BC: tl.constexpr, ACC: tl.constexpr):
    """(Ms, Pp): Ms[i, j] = M[i-1, j] for j < i, Pp[i] = P[i-1] (Pp[0] = 1)."""
    i = offs_c[:, None]
    j = offs_c[None, :]
    dp = tl.load(D + d_off + (t - 1) * sd_t, mask=tmask & (offs_c > 0), other=1.0).to(ACC)
    ms = tl.cumprod(tl.where(i > j + 1, dp[:, None], 1.0).to(ACC), axis=0)
    ms = tl.where(i > j, ms, 0.0)
    return ms, tl.cumprod(dp, axis=0)


@triton.jit
def _lightning_fwd_kernel(
    Q, K, V, D, S0, O, SF,
    T, H, DK, DV,
    sq_b, sq_h, sq_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t, so_b, so_h, so_t,
    HAS_DECAY: tl.constexpr, HAS_S0: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    kmask = offs_k < DK
    vmask = offs_v < DV
    s_ptr = (b * H + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    smask = kmask[:, None] & vmask[None, :]
    if HAS_S0:
        s = tl.load(S0 + s_ptr, mask=smask, other=0.0).to(ACC)
    else:
        s = tl.zeros([BK, BV], dtype=ACC)
    q_base = b * sq_b + h * sq_h
    v_base = b * sv_b + h * sv_h
    d_off = b * sd_b + h * sd_h
    for c0 in range(0, T, BC):
        t = (c0 + offs_c).to(tl.int64)
        tmask = t < T
        q = tl.load(Q + q_base + t[:, None] * sq_t + offs_k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0).to(ACC)
        k = tl.load(K + q_base + t[:, None] * sq_t + offs_k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0).to(ACC)
        v = tl.load(V + v_base + t[:, None] * sv_t + offs_v[None, :], mask=tmask[:, None] & vmask[None, :], other=0.0).to(ACC)
        m, p, gam, pe = _decay_factors(D, d_off, t, sd_t, tmask, offs_c, HAS_DECAY, BC, ACC)
        scores = tl.dot(q, tl.trans(k), input_precision=PREC) * m
        o = tl.dot(scores, v, input_precision=PREC) + tl.dot(q * p[:, None], s, input_precision=PREC)
        tl.store(O + b * so_b + h * so_h + t[:, None] * so_t + offs_v[None, :], o, mask=tmask[:, None] & vmask[None, :])
        s = pe * s + tl.dot(tl.trans(k * gam[:, None]), v, input_precision=PREC)
    tl.store(SF + s_ptr, s, mask=smask)


@triton.jit
def _lightning_bwd_kernel(
    Q, K, V, D, S0, DO, DS, DQ, DK_, DV_, DD, DS0, SCR,
    T, H, DK, DV, NC,
    sq_b, sq_h, sq_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t,
    HAS_DECAY: tl.constexpr, HAS_S0: tl.constexpr, HAS_DS: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    kmask = offs_k < DK
    vmask = offs_v < DV
    s_ptr = (b * H + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    smask = kmask[:, None] & vmask[None, :]
    scr = SCR + pid_bh.to(tl.int64) * NC * BK * BV + offs_k[:, None] * BV + offs_v[None, :]
    q_base = b * sq_b + h * sq_h
    v_base = b * sv_b + h * sv_h
    d_off = b * sd_b + h * sd_h
    if HAS_S0:
        s = tl.load(S0 + s_ptr, mask=smask, other=0.0).to(ACC)
    else:
        s = tl.zeros([BK, BV], dtype=ACC)
    # Loop 1 (left to right): save entering states, dQ = ((dO V^T) * M) K + (P dO) S_c^T.
    for ci in range(0, NC):
        t = (ci * BC + offs_c).to(tl.int64)
        tmask = t < T
        qk_mask = tmask[:, None] & kmask[None, :]
        v_mask = tmask[:, None] & vmask[None, :]
        tl.store(scr + ci * BK * BV, s)
        k = tl.load(K + q_base + t[:, None] * sq_t + offs_k[None, :], mask=qk_mask, other=0.0).to(ACC)
        v = tl.load(V + v_base + t[:, None] * sv_t + offs_v[None, :], mask=v_mask, other=0.0).to(ACC)
        do = tl.load(DO + v_base + t[:, None] * sv_t + offs_v[None, :], mask=v_mask, other=0.0).to(ACC)
        m, p, gam, pe = _decay_factors(D, d_off, t, sd_t, tmask, offs_c, HAS_DECAY, BC, ACC)
        dov = tl.dot(do, tl.trans(v), input_precision=PREC) * m
        dq = tl.dot(dov, k, input_precision=PREC) + tl.dot(do * p[:, None], tl.trans(s), input_precision=PREC)
        tl.store(DQ + q_base + t[:, None] * sq_t + offs_k[None, :], dq, mask=qk_mask)
        s = pe * s + tl.dot(tl.trans(k * gam[:, None]), v, input_precision=PREC)
    # Loop 2 (right to left): dK, dV, d decay; Gx carries dL/dS at the chunk end.
    if HAS_DS:
        gx = tl.load(DS + s_ptr, mask=smask, other=0.0).to(ACC)
    else:
        gx = tl.zeros([BK, BV], dtype=ACC)
    for r in range(0, NC):
        ci = NC - 1 - r
        t = (ci * BC + offs_c).to(tl.int64)
        tmask = t < T
        qk_mask = tmask[:, None] & kmask[None, :]
        v_mask = tmask[:, None] & vmask[None, :]
        s = tl.load(scr + ci * BK * BV)
        q = tl.load(Q + q_base + t[:, None] * sq_t + offs_k[None, :], mask=qk_mask, other=0.0).to(ACC)
        k = tl.load(K + q_base + t[:, None] * sq_t + offs_k[None, :], mask=qk_mask, other=0.0).to(ACC)
        v = tl.load(V + v_base + t[:, None] * sv_t + offs_v[None, :], mask=v_mask, other=0.0).to(ACC)
        do = tl.load(DO + v_base + t[:, None] * sv_t + offs_v[None, :], mask=v_mask, other=0.0).to(ACC)
        m, p, gam, pe = _decay_factors(D, d_off, t, sd_t, tmask, offs_c, HAS_DECAY, BC, ACC)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        dov = tl.dot(do, tl.trans(v), input_precision=PREC)
        dk = tl.dot(tl.trans(dov * m), q, input_precision=PREC) + gam[:, None] * tl.dot(v, tl.trans(gx), input_precision=PREC)
        dv = tl.dot(tl.trans(qk * m), do, input_precision=PREC) + gam[:, None] * tl.dot(k, gx, input_precision=PREC)
        tl.store(DK_ + q_base + t[:, None] * sq_t + offs_k[None, :], dk, mask=qk_mask)
        tl.store(DV_ + v_base + t[:, None] * sv_t + offs_v[None, :], dv, mask=v_mask)
        if HAS_DECAY:
            ms, pp = _shifted_factors(D, d_off, t, sd_t, tmask, offs_c, BC, ACC)
            w = tl.sum(tl.dot(q, s, input_precision=PREC) * do, axis=1)
            z = tl.sum(tl.dot(k, gx, input_precision=PREC) * v, axis=1)
            t1 = pp * tl.sum(m * w[:, None], axis=0)
            t2 = pp * gam * tl.sum(tl.sum(gx * s, axis=1), axis=0)
            t3 = gam * tl.sum(ms * z[None, :], axis=1)
            t4 = tl.sum(m * tl.dot(qk * dov, tl.trans(ms), input_precision=PREC), axis=0)
            tl.store(DD + pid_bh.to(tl.int64) * T + t, t1 + t2 + t3 + t4, mask=tmask)
        gx = pe * gx + tl.dot(tl.trans(q * p[:, None]), do, input_precision=PREC)
    tl.store(DS0 + s_ptr, gx, mask=smask)


def _block_c(chunk_size: int) -> int:
    """Kernel chunk: the requested chunk rounded to a power of two in [16, 128] (results do not depend on it)."""
    return min(128, pow2(chunk_size)) if not INTERPRETED else min(32, pow2(chunk_size))


def _decay_args(decay: Optional[torch.Tensor], like: torch.Tensor):
    """(tensor, strides) of a per-step decay view (B, H, T); stride-0 views of (H,) stay cheap."""
    if decay is None:
        return like, (0, 0, 0)
    return decay, tuple(decay.stride())


@serialized_launch
def lightning_fwd_triton(q, k, v, decay, s0, chunk_size: int, out_dtype: torch.dtype, acc: torch.dtype):
    """Forward. ``decay`` None or per step (B, H, T); returns (o in out_dtype, final state in acc)."""
    check_device(q)
    b, h, length, dk = q.shape
    dv = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty((b, h, length, dv), dtype=out_dtype, device=q.device)
    final = torch.empty((b, h, dk, dv), dtype=acc, device=q.device)
    s0c = None if s0 is None else s0.contiguous()
    if b * h == 0:
        return o, final
    d_t, d_s = _decay_args(decay, q)
    bk = pow2(dk)
    bv = min(pow2(dv), 64) if not INTERPRETED else pow2(dv)
    grid = (b * h, triton.cdiv(dv, bv))
    _lightning_fwd_kernel[grid](
        q, k, v, d_t, s0c if s0c is not None else final, o, final, length, h, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), *d_s,
        o.stride(0), o.stride(1), o.stride(2),
        HAS_DECAY=decay is not None, HAS_S0=s0c is not None, BC=_block_c(chunk_size), BK=bk, BV=bv,
        ACC=tl_dtype(acc), PREC=dot_precision(q.dtype),
    )
    return o, final


@serialized_launch
def lightning_bwd_triton(q, k, v, decay, s0, do, ds, chunk_size: int, acc: torch.dtype):
    """Backward. Returns (dq, dk, dv in the inputs' dtypes, dd per step (B, H, T) or None, dS0 in acc)."""
    check_device(q)
    b, h, length, dk = q.shape
    dv = v.shape[-1]
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    do = do.to(v.dtype).contiguous()
    dq, dk_, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dd = None if decay is None else torch.empty((b, h, length), dtype=acc, device=q.device)
    ds0 = torch.empty((b, h, dk, dv), dtype=acc, device=q.device)
    if b * h == 0:
        return dq, dk_, dv_, dd, ds0
    bc, bk, bv = _block_c(chunk_size), pow2(dk), pow2(dv)
    nc = triton.cdiv(length, bc)
    scratch = torch.empty((b * h, max(nc, 1), bk, bv), dtype=acc, device=q.device)
    d_t, d_s = _decay_args(decay, q)
    s0c = None if s0 is None else s0.contiguous()
    dsc = None if ds is None else ds.contiguous()
    _lightning_bwd_kernel[(b * h,)](
        q, k, v, d_t, s0c if s0c is not None else ds0, do, dsc if dsc is not None else ds0,
        dq, dk_, dv_, dd if dd is not None else ds0, ds0, scratch,
        length, h, dk, dv, nc,
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), *d_s,
        HAS_DECAY=decay is not None, HAS_S0=s0c is not None, HAS_DS=dsc is not None,
        BC=bc, BK=bk, BV=bv, ACC=tl_dtype(acc), PREC=dot_precision(q.dtype),
    )
    return dq, dk_, dv_, dd, ds0
