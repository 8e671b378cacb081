"""Fused sequential lightning attention kernels: the state (or its gradient) stays in registers.

Lightning Attention-2's sequential form: a program per head (and block of the state) walks the
chunks in order, carrying the ``dk x dv`` state in registers, so no chunk state goes through
global memory and every input is read once per sweep. Formulas and notation:
:mod:`gradshard.kernels.lightning_torch`; shared device helpers: :mod:`.lightning_common`.

* forward, :func:`_fused_forward_kernel` (a program per head and dv block):
  ``O_c = ((Q K^T) * M) V + (P Q_c) S``, then ``S <- Pe_c S + (Gam K_c)^T V_c``.
* backward, two sweeps (:func:`run_fused_backward`):

  1. :func:`_fused_bwd_dq_kernel`, forward over the chunks, a program per head and **dk** block
     holding ``S[kblk, :]`` (the whole value width): ``dQ_c = ((dO V^T) * M) K + (P dO) S_c^T``.
     dQ's columns are dk-indexed, so each program writes its columns complete and dQ is written
     once (no per-dv-block partial sums through memory); the price is reading v and dO once per
     dk block (once in all where one block covers the head).
  2. :func:`_fused_bwd_dkv_kernel`, reverse over the chunks, a program per head and **dv** block
     holding ``Gx[:, vblk]`` seeded with ``dS_final``: ``dV_c`` (complete per block),
     ``dK_c`` (a dv block's share; summed afterwards when there are several blocks), the decay
     gradient's share and finally ``dS_0``.

The decay gradient is the exact, division-free chunk formula (``dd_t = <G_t, S_{t-1}>``, any
decay including 0). Its term ``Pp * Gam * <Gx_c, S_c>`` pairs the reverse sweep's gradient with
the forward sweep's state entering the same chunk, so with a decay, sweep 1 also writes each
chunk's entering state (float32, ``dk * dv * 4 / C`` bytes per token and head) for sweep 2 to
read. Every gradient-only identity (fla's ``d log g = q.dq - k.dk`` reverse cumsum) gives
``d_t * dd_t`` and needs a division by the decay; with a zero decay the pairing of the prefix's
state and the suffix's gradient is not recoverable from scalars at all, hence the states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .layout import INTERPRETED, dot_precision, pow2, tl_dtype
from .lightning_common import NUM_WARPS, _chunk_tile, _decay_args, _decay_factors, _rows, _shifted_factors


@triton.jit
def _fused_forward_kernel(
    Q, K, V, D, S0, O, SF,
    T, H, DK, DV, NC,
    sq_b, sq_h, sq_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t, so_b, so_h, so_t,
    HAS_DECAY: tl.constexpr, HAS_S0: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (batch x head, dv block) walks the chunks in order with the state in
    registers (Lightning Attention-2's forward): ``O_c = ((Q K^T) * M) V + (P Q_c) S``, then
    ``S <- Pe_c S + (Gam K_c)^T V_c``; q, k, v are read once, o and the final state written
    once (``SF``), and no chunk state goes through global memory."""
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b, h, offs_c, offs_k, offs_v, kmask, vmask, _, _ = _chunk_tile(pid_bh, 0, pid_v, H, T, DK, DV, BC, BK, BV)
    smask = kmask[:, None] & vmask[None, :]
    state = pid_bh.to(tl.int64) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    if HAS_S0:
        s = tl.load(S0 + state, mask=smask, other=0.0).to(ACC)
    else:
        s = tl.zeros([BK, BV], dtype=ACC)
    q_base = b * sq_b + h * sq_h
    v_base = b * sv_b + h * sv_h
    d_base = b * sd_b + h * sd_h
    for c in range(0, NC):
        t = (c * BC + offs_c).to(tl.int64)
        tmask = t < T
        qk_mask = tmask[:, None] & kmask[None, :]
        v_mask = tmask[:, None] & vmask[None, :]
        q = _rows(Q, q_base, t, sq_t, offs_k, qk_mask, ACC)
        k = _rows(K, q_base, t, sq_t, offs_k, qk_mask, ACC)
        v = _rows(V, v_base, t, sv_t, offs_v, v_mask, ACC)
        m, p, gam, pe = _decay_factors(D, d_base, t, sd_t, tmask, offs_c, HAS_DECAY, BC, ACC)
        scores = tl.dot(q, tl.trans(k), input_precision=PREC) * m
        o = tl.dot(scores, v, input_precision=PREC) + tl.dot(q * p[:, None], s, input_precision=PREC)
        tl.store(O + b * so_b + h * so_h + t[:, None] * so_t + offs_v[None, :], o, mask=v_mask)
        s = pe * s + tl.dot(tl.trans(k * gam[:, None]), v, input_precision=PREC)
    tl.store(SF + state, s, mask=smask)


@triton.jit
def _fused_bwd_dq_kernel(
    K, V, D, DO, S0, DQ, SA,
    T, H, DK, DV, NC,
    sq_b, sq_h, sq_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t,
    HAS_DECAY: tl.constexpr, HAS_S0: tl.constexpr, STORE_STATES: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    """Sweep 1: one program per (batch x head, dk block ``pid_k``) walks the chunks in order with
    ``S[kblk, :]`` (all ``BV >= dv`` values) in registers and writes ``dQ_c[:, kblk] =
    ((dO V^T) * M) K[:, kblk] + (P dO) S_c[kblk, :]^T``, complete. With ``STORE_STATES`` it also
    writes the state entering every chunk to ``SA`` (B*H, NC, dk, dv) for the decay gradient."""
    pid_bh = tl.program_id(0)
    pid_k = tl.program_id(1)
    b, h, offs_c, _, offs_v, _, vmask, _, _ = _chunk_tile(pid_bh, 0, 0, H, T, DK, DV, BC, BK, BV)
    offs_k = pid_k * BK + tl.arange(0, BK)
    kmask = offs_k < DK
    smask = kmask[:, None] & vmask[None, :]
    inner = offs_k[:, None] * DV + offs_v[None, :]
    bh = pid_bh.to(tl.int64)
    if HAS_S0:
        s = tl.load(S0 + bh * DK * DV + inner, mask=smask, other=0.0).to(ACC)
    else:
        s = tl.zeros([BK, BV], dtype=ACC)
    q_base = b * sq_b + h * sq_h
    v_base = b * sv_b + h * sv_h
    d_base = b * sd_b + h * sd_h
    for c in range(0, NC):
        t = (c * BC + offs_c).to(tl.int64)
        tmask = t < T
        qk_mask = tmask[:, None] & kmask[None, :]
        v_mask = tmask[:, None] & vmask[None, :]
        if STORE_STATES:
            tl.store(SA + (bh * NC + c) * DK * DV + inner, s, mask=smask)
        k = _rows(K, q_base, t, sq_t, offs_k, qk_mask, ACC)
        v = _rows(V, v_base, t, sv_t, offs_v, v_mask, ACC)
        do = _rows(DO, v_base, t, sv_t, offs_v, v_mask, ACC)
        m, p, gam, pe = _decay_factors(D, d_base, t, sd_t, tmask, offs_c, HAS_DECAY, BC, ACC)
        dovm = tl.dot(do, tl.trans(v), input_precision=PREC) * m
        dq = tl.dot(dovm, k, input_precision=PREC) + tl.dot(do * p[:, None], tl.trans(s), input_precision=PREC)
        tl.store(DQ + q_base + t[:, None] * sq_t + offs_k[None, :], dq, mask=qk_mask)
        s = pe * s + tl.dot(tl.trans(k * gam[:, None]), v, input_precision=PREC)


@triton.jit
def _fused_bwd_dkv_kernel(
    Q, K, V, D, DO, DS, SA, DK_, DV_, DD, DS0,
    T, H, DK, DV, NC,
    sq_b, sq_h, sq_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t, sk_part, sdd_part,
    HAS_DECAY: tl.constexpr, HAS_DS: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    """Sweep 2: one program per (batch x head, dv block ``pid_v``) walks the chunks in reverse
    with ``G = Gx[:, vblk]`` (all ``BK >= dk`` keys; seeded with ``dS_final``) in registers:
    ``dV_c = ((Q K^T) * M)^T dO_c + Gam (K G)`` (complete), the block's share of
    ``dK_c = ((V dO^T) * M^T) Q + Gam (V G^T)`` (at ``DK_ + pid_v * sk_part``), with a decay the
    block's share of the decay gradient (at ``DD + pid_v * sdd_part``; the state entering the
    chunk read from ``SA``), then ``G <- Pe_c G + (P Q_c)^T dO_c``; at the end ``dS_0 = G``."""
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b, h, offs_c, offs_k, offs_v, kmask, vmask, _, _ = _chunk_tile(pid_bh, 0, pid_v, H, T, DK, DV, BC, BK, BV)
    smask = kmask[:, None] & vmask[None, :]
    inner = offs_k[:, None] * DV + offs_v[None, :]
    bh = pid_bh.to(tl.int64)
    if HAS_DS:
        g = tl.load(DS + bh * DK * DV + inner, mask=smask, other=0.0).to(ACC)
    else:
        g = tl.zeros([BK, BV], dtype=ACC)
    q_base = b * sq_b + h * sq_h
    v_base = b * sv_b + h * sv_h
    d_base = b * sd_b + h * sd_h
    for i in tl.range(0, NC, num_stages=1):
        c = NC - 1 - i
        t = (c * BC + offs_c).to(tl.int64)
        tmask = t < T
        qk_mask = tmask[:, None] & kmask[None, :]
        v_mask = tmask[:, None] & vmask[None, :]
        q = _rows(Q, q_base, t, sq_t, offs_k, qk_mask, ACC)
        k = _rows(K, q_base, t, sq_t, offs_k, qk_mask, ACC)
        v = _rows(V, v_base, t, sv_t, offs_v, v_mask, ACC)
        do = _rows(DO, v_base, t, sv_t, offs_v, v_mask, ACC)
        m, p, gam, pe = _decay_factors(D, d_base, t, sd_t, tmask, offs_c, HAS_DECAY, BC, ACC)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        dov = tl.dot(do, tl.trans(v), input_precision=PREC)
        kg = tl.dot(k, g, input_precision=PREC)
        if HAS_DECAY:  # the terms without S_c first, so that Ms dies early
            ms, pp = _shifted_factors(D, d_base, t, sd_t, tmask, offs_c, BC, ACC)
            z = tl.sum(kg * v, axis=1)
            dd = gam * tl.sum(ms * z[None, :], axis=1)
            dd += tl.sum(m * tl.dot(qk * dov, tl.trans(ms), input_precision=PREC), axis=0)
        dv = tl.dot(tl.trans(qk * m), do, input_precision=PREC) + gam[:, None] * kg
        tl.store(DV_ + v_base + t[:, None] * sv_t + offs_v[None, :], dv, mask=v_mask)
        dk = tl.dot(tl.trans(dov * m), q, input_precision=PREC) + gam[:, None] * tl.dot(v, tl.trans(g), input_precision=PREC)
        tl.store(DK_ + pid_v * sk_part + q_base + t[:, None] * sq_t + offs_k[None, :], dk, mask=qk_mask)
        if HAS_DECAY:
            s = tl.load(SA + (bh * NC + c) * DK * DV + inner, mask=smask, other=0.0).to(ACC)
            w = tl.sum(tl.dot(q, s, input_precision=PREC) * do, axis=1)
            sg = tl.sum(tl.sum(g * s, axis=1), axis=0)
            dd += pp * tl.sum(m * w[:, None], axis=0) + pp * gam * sg
            tl.store(DD + pid_v * sdd_part + bh * T + t, dd, mask=tmask)
        g = pe * g + tl.dot(tl.trans(q * p[:, None]), do, input_precision=PREC)
    tl.store(DS0 + bh * DK * DV + inner, g, mask=smask)


def _fused_tiles(chunk_size: int, dk: int, dv: int) -> tuple[int, int]:
    """(chunk, dv block) of :func:`_fused_forward_kernel`: chunks of 32; the whole value head
    up to 64, 32-wide blocks for heads wider than 64 (the ahead-of-time compile, bfloat16 with a
    decay and a state: chunk 64 spilled 320-2184 B per thread at d=64; d=128 with 64-wide blocks
    184-232 B; chunk 32 with these blocks none on sm_90, none on sm_80 but 56 B at d=64). A head
    of 128 then reads q and k once per value block. The interpreter uses 16-wide blocks so tests
    with dv > 16 cover several."""
    bc = min(32, pow2(chunk_size))
    if INTERPRETED:
        return bc, 16
    return bc, 32 if pow2(dk) > 64 else min(pow2(dv), 64)


def _fills_gpu(device: torch.device, programs: int) -> bool:
    """Whether ``programs`` sequential programs give every SM of ``device`` two (never under the
    interpreter or on CPU tensors: tests and the ahead-of-time compile ask by ``fused=True``)."""
    if INTERPRETED or device.type != "cuda":
        return False
    return programs >= 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _fused_forward(b: int, h: int, dk: int, dv: int, device: torch.device) -> bool:
    """Whether the forward runs :func:`_fused_forward_kernel` (a program per head and dv block,
    the chunks in sequence; the op's minimum traffic) rather than the chunk-parallel kernels
    (chunks x heads programs; every chunk's state through global memory, 5.6-7.1x the minimum
    traffic: RESULTS "Bytes moved per kernel"): when heads x dv blocks give every SM two
    programs. Not timed on a GPU yet."""
    return _fills_gpu(device, b * h * triton.cdiv(dv, _fused_tiles(64, dk, dv)[1]))


def run_fused_forward(q, k, v, decay, s0, o, chunk_size: int, acc: torch.dtype) -> torch.Tensor:
    """Fill ``o`` (B, H, T, dv) with the forward of contiguous q, k, v; returns the final state in ``acc``."""
    b, h, length, dk = q.shape
    dv = v.shape[-1]
    final = torch.empty((b, h, dk, dv), dtype=acc, device=q.device)
    d_t, d_s = _decay_args(decay, q)
    bc, bv = _fused_tiles(chunk_size, dk, dv)
    _fused_forward_kernel[(b * h, triton.cdiv(dv, bv))](
        q, k, v, d_t, s0 if s0 is not None else final, o, final, length, h, dk, dv, triton.cdiv(length, bc),
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), *d_s,
        o.stride(0), o.stride(1), o.stride(2),
        HAS_DECAY=decay is not None, HAS_S0=s0 is not None, BC=bc, BK=pow2(dk), BV=bv,
        ACC=tl_dtype(acc), PREC=dot_precision(q.dtype), num_warps=NUM_WARPS,
    )
    return final


@dataclass(frozen=True)
class FusedBackwardTiles:
    """Tiles of the fused backward: ``chunk`` (both sweeps), the dk block of the dQ sweep (which
    holds every value) and the dv block of the dK/dV sweep (which holds every key)."""

    chunk: int
    dq_block_k: int
    dkv_block_v: int


def fused_backward_tiles(chunk_size: int, dk: int, dv: int) -> FusedBackwardTiles:
    """:class:`FusedBackwardTiles` for heads of ``dk`` x ``dv``: chunks of 32, 64-wide blocks
    (one block of each kind for heads up to 64: every input read once per sweep, dK written
    directly). The ahead-of-time compile (chunk 32, 8 warps, S0 and dS given) keeps every value
    in registers only for the bfloat16 d=64 dQ sweep on sm_90 and the d=64 dK/dV sweep without a
    decay; the dK/dV sweep with a decay spills 968 B per thread (bf16 d=64, sm_90; 664 with
    16-wide dv blocks, 488-1224 in the variants tried), 2120 B at d=128; float32 inputs (FMA
    dots) spill 0.8-6.8 KB in both sweeps; sm_80 more. The interpreter's 16-wide blocks let
    tests with dims above 16 walk several blocks of each kind."""
    chunk = min(32, pow2(chunk_size))
    if INTERPRETED:
        return FusedBackwardTiles(chunk, 16, 16)
    return FusedBackwardTiles(chunk, min(pow2(dk), 64), min(pow2(dv), 64))


def _fused_backward(b: int, h: int, dk: int, dv: int, device: torch.device, dtype: torch.dtype,
                    has_decay: bool) -> bool:
    """Whether the backward runs the fused sweeps (:func:`run_fused_backward`; 1.34-1.39x the
    op's minimum traffic without a decay, 1.9-2.3x with one, against 6.5-9.1x for the
    chunk-parallel kernels at d=64) rather than the chunk-parallel kernels: only where the
    ahead-of-time compile keeps both sweeps in registers (sm_90 or newer, half inputs, heads up
    to 64, no decay: :func:`fused_backward_tiles`) and heads x blocks give every SM two programs.
    A spilling sweep may still beat the chunk-parallel kernels' traffic; not timed on a GPU yet,
    so the choice stays with what compiles clean (``fused=True`` forces it)."""
    if has_decay or dtype not in (torch.bfloat16, torch.float16) or max(pow2(dk), pow2(dv)) > 64:
        return False
    if INTERPRETED or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    tiles = fused_backward_tiles(64, dk, dv)
    return _fills_gpu(device, b * h * min(triton.cdiv(dk, tiles.dq_block_k), triton.cdiv(dv, tiles.dkv_block_v)))


def run_fused_backward(q, k, v, decay, s0, do, ds, chunk_size: int, acc: torch.dtype,
                       dq: torch.Tensor, dk_: torch.Tensor, dv_: torch.Tensor,
                       dd: Optional[torch.Tensor]) -> torch.Tensor:
    """Fill dq, dk_, dv_ (like q, k, v) and ``dd`` (B, H, T, or None without a decay) from
    contiguous inputs by the two sweeps; returns dS0 (B, H, dk, dv) in ``acc``."""
    b, h, length, dk = q.shape
    dv = v.shape[-1]
    tiles = fused_backward_tiles(chunk_size, dk, dv)
    bc = tiles.chunk
    nc = triton.cdiv(length, bc)
    nk, nv = triton.cdiv(dk, tiles.dq_block_k), triton.cdiv(dv, tiles.dkv_block_v)
    d_t, d_s = _decay_args(decay, q)
    strides = (q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), *d_s)
    consts = dict(BC=bc, ACC=tl_dtype(acc), PREC=dot_precision(q.dtype), num_warps=NUM_WARPS)
    ds0 = torch.empty((b, h, dk, dv), dtype=acc, device=q.device)
    # the states entering every chunk, only for the decay gradient's <Gx_c, S_c> term
    states = torch.empty((b * h, nc, dk, dv), dtype=acc, device=q.device) if decay is not None else ds0
    _fused_bwd_dq_kernel[(b * h, nk)](
        k, v, d_t, do, s0 if s0 is not None else ds0, dq, states, length, h, dk, dv, nc, *strides,
        HAS_DECAY=decay is not None, HAS_S0=s0 is not None, STORE_STATES=decay is not None,
        BK=tiles.dq_block_k, BV=pow2(dv), **consts,
    )
    dk_parts = dk_ if nv == 1 else torch.empty((nv, *q.shape), dtype=acc, device=q.device)
    dd_parts = dd if nv == 1 or dd is None else torch.empty((nv, b, h, length), dtype=acc, device=q.device)
    _fused_bwd_dkv_kernel[(b * h, nv)](
        q, k, v, d_t, do, ds if ds is not None else ds0, states, dk_parts, dv_,
        dd_parts if dd_parts is not None else ds0, ds0, length, h, dk, dv, nc, *strides,
        dk_parts[0].numel() if nv > 1 else 0, b * h * length if nv > 1 else 0,
        HAS_DECAY=decay is not None, HAS_DS=ds is not None, BK=pow2(dk), BV=tiles.dkv_block_v, **consts,
    )
    if nv > 1:
        dk_.copy_(dk_parts.sum(0))
        if dd is not None:
            torch.sum(dd_parts, dim=0, out=dd)
    return ds0
