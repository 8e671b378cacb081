"""Triton lightning attention: forward and backward, chunk-parallel, state in and out.

Shared device helpers: :mod:`.lightning_common`.

Formulas: :mod:`gradshard.kernels.lightning_torch` (same notation: M, Ms, P, Pp, Gam, Pe).
The decay factors are built in registers by cumulative products (``tl.cumprod``), never by
dividing or by exponentiating log-decay differences.

Every stage is parallel over chunks; the only sequential part, the chunk-to-chunk state
recurrence ``S_{c+1} = Pe_c S_c + U_c``, is itself a diagonal linear scan and runs on
:func:`gradshard.kernels.triton.scan.scan_triton` (over ``T / C`` steps, ``dk * dv`` channels):

* forward: ``_chunk_outer_kernel`` writes every chunk's increment ``U_c = (Gam K_c)^T V_c`` and
  ``Pe_c``; the scan gives the state after every chunk; ``_chunk_output_kernel`` writes
  ``O_c = ((Q K^T) * M) V + (P Q_c) S_c`` (grid: chunks x heads x dv blocks).
* backward: the same two steps rebuild the states entering each chunk; ``_chunk_outer_kernel``
  with ``P`` weights gives ``W_c = (P Q_c)^T dO_c`` and a reverse scan seeded with ``dS_final``
  gives the gradient ``Gx_c`` reaching each chunk's end (and ``dS_0``); ``_chunk_grad_qk_kernel``
  writes dQ and dK of every chunk (grid: chunks x heads), ``_chunk_grad_v_kernel`` dV and
  ``_chunk_grad_decay_kernel`` the per-step decay gradient (grid: chunks x heads x dv blocks;
  a dv block's share of the decay gradient goes to its own buffer row, summed afterwards).

So the GPU sees ``T / C * B * H`` programs instead of ``B * H`` walking ``T`` sequentially
(the previous design: 16 programs on a 132-SM H100 at B=2, H=8). Where heads and blocks alone
fill the GPU, the forward and the backward instead run the sequential kernels of
:mod:`.lightning_fused` (Lightning Attention-2's form: a program per head and block carries the
state, or its gradient, in registers over the chunks; ``fused=`` forces either path). The
chunk-parallel kernels' price is the per-chunk states in global memory, ``T / C * dk * dv`` float32 values per head, freed when the call
returns: the chunk scan runs in place over the increments, so the forward holds one such buffer
and the backward two. That is ``dk * dv * 4 / C`` bytes per token and head: with the chunks
the register budget allows (C = 32 in the backward, 32-64 in the forward; see
:class:`BackwardTiles`), 512 B at d = 64 and 2 KiB at d = 128.
flash-linear-attention's chunk kernels hold the same states, by default in the inputs' dtype;
gradshard keeps float32 (exact accumulation) and says so here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .layout import INTERPRETED, check_device, dot_precision, pow2, serialized_launch, tl_dtype
from .lightning_common import (NUM_WARPS, _chunk_tile, _decay_args, _decay_factors, _empty_sequence_state, _rows,
                               _shifted_factors)
from .lightning_fused import _fused_backward, _fused_forward, run_fused_backward, run_fused_forward
from .scan import scan_triton


@triton.jit
def _neighbour_state(BUF, EDGE, pid_bh, pid_c, NC, DK, DV, offs_k, offs_v, smask,
                     STEP: tl.constexpr, HAS_EDGE: tl.constexpr, ACC: tl.constexpr):
    """``BUF[bh, c + STEP]`` (a (B*H, NC, dk, dv) chunk-state buffer), or ``EDGE[bh]`` (or 0)
    when ``c + STEP`` falls off the sequence: the state entering a chunk (STEP = -1, edge = S0)
    or the gradient leaving it (STEP = +1, edge = dS_final)."""
    inner = offs_k[:, None] * DV + offs_v[None, :]
    bh = pid_bh.to(tl.int64)
    j = tl.zeros_like(inner) + (pid_c + STEP)  # the neighbour's chunk index, as a tile (for masks)
    inside = (j >= 0) & (j < NC)
    jc = tl.minimum(tl.maximum(j, 0), NC - 1).to(tl.int64)
    s = tl.load(BUF + (bh * NC + jc) * DK * DV + inner, mask=smask & inside, other=0.0).to(ACC)
    if HAS_EDGE:
        s += tl.load(EDGE + bh * DK * DV + inner, mask=smask & ((j < 0) | (j >= NC)), other=0.0).to(ACC)
    return s


@triton.jit
def _chunk_outer_kernel(
    X, Y, D, U, PE,
    T, H, DK, DV, NC,
    sx_b, sx_h, sx_t, sy_b, sy_h, sy_t, sd_b, sd_h, sd_t,
    FROM_START: tl.constexpr, HAS_DECAY: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    """``U[bh, c] = (w X_c)^T Y_c`` with ``w = P`` (FROM_START) or ``Gam``, and ``PE[bh, c] = Pe_c``."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_v = tl.program_id(2)
    b, h, offs_c, offs_k, offs_v, kmask, vmask, t, tmask = _chunk_tile(pid_bh, pid_c, pid_v, H, T, DK, DV, BC, BK, BV)
    x = _rows(X, b * sx_b + h * sx_h, t, sx_t, offs_k, tmask[:, None] & kmask[None, :], ACC)
    y = _rows(Y, b * sy_b + h * sy_h, t, sy_t, offs_v, tmask[:, None] & vmask[None, :], ACC)
    m, p, gam, pe = _decay_factors(D, b * sd_b + h * sd_h, t, sd_t, tmask, offs_c, HAS_DECAY, BC, ACC)
    if FROM_START:
        w = p
    else:
        w = gam
    u = tl.dot(tl.trans(x * w[:, None]), y, input_precision=PREC)
    u_ptr = U + (pid_bh.to(tl.int64) * NC + pid_c) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    tl.store(u_ptr, u, mask=kmask[:, None] & vmask[None, :])
    if pid_v == 0:
        tl.store(PE + pid_bh.to(tl.int64) * NC + pid_c, pe)


@triton.jit
def _chunk_output_kernel(
    Q, K, V, D, SA, S0, O,
    T, H, DK, DV, NC,
    sq_b, sq_h, sq_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t, so_b, so_h, so_t,
    HAS_DECAY: tl.constexpr, HAS_S0: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    """``O_c = ((Q K^T) * M) V + (P Q_c) S_c``, ``S_c`` read from the chunk-state scan ``SA``."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_v = tl.program_id(2)
    b, h, offs_c, offs_k, offs_v, kmask, vmask, t, tmask = _chunk_tile(pid_bh, pid_c, pid_v, H, T, DK, DV, BC, BK, BV)
    qk_mask = tmask[:, None] & kmask[None, :]
    v_mask = tmask[:, None] & vmask[None, :]
    q_base = b * sq_b + h * sq_h
    q = _rows(Q, q_base, t, sq_t, offs_k, qk_mask, ACC)
    k = _rows(K, q_base, t, sq_t, offs_k, qk_mask, ACC)
    v = _rows(V, b * sv_b + h * sv_h, t, sv_t, offs_v, v_mask, ACC)
    m, p, gam, pe = _decay_factors(D, b * sd_b + h * sd_h, t, sd_t, tmask, offs_c, HAS_DECAY, BC, ACC)
    s = _neighbour_state(SA, S0, pid_bh, pid_c, NC, DK, DV, offs_k, offs_v, kmask[:, None] & vmask[None, :],
                         -1, HAS_S0, ACC)
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * m
    o = tl.dot(scores, v, input_precision=PREC) + tl.dot(q * p[:, None], s, input_precision=PREC)
    tl.store(O + b * so_b + h * so_h + t[:, None] * so_t + offs_v[None, :], o, mask=v_mask)


@triton.jit
def _chunk_grad_qk_kernel(
    Q, K, V, D, DO, SA, S0, RA, DS, DQ, DK_,
    T, H, DK, DV, NC,
    sq_b, sq_h, sq_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t,
    HAS_DECAY: tl.constexpr, HAS_S0: tl.constexpr, HAS_DS: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    """dQ and dK of one chunk, from the state entering it (``SA``, edge ``S0``) and the
    gradient reaching its end (``RA``, edge ``DS``).

    The value dimension is walked in ``BV`` blocks (so a 128 x 128 state never sits in one
    tile): each block adds its share of ``dO V^T`` and of the state terms of dQ and dK. dV and
    the decay gradient are other kernels' (:func:`_chunk_grad_v_kernel`,
    :func:`_chunk_grad_decay_kernel`): one kernel computing all of them held every tile at once
    and spilled registers at every tile size (sm_90, heads of 64 and 128).
    """
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h, offs_c, offs_k, _, kmask, _, t, tmask = _chunk_tile(pid_bh, pid_c, 0, H, T, DK, DV, BC, BK, BV)
    qk_mask = tmask[:, None] & kmask[None, :]
    q_base = b * sq_b + h * sq_h
    v_base = b * sv_b + h * sv_h
    m, p, gam, pe = _decay_factors(D, b * sd_b + h * sd_h, t, sd_t, tmask, offs_c, HAS_DECAY, BC, ACC)
    dov = tl.zeros([BC, BC], dtype=ACC)      # dO V^T
    dq_s = tl.zeros([BC, BK], dtype=ACC)     # (P dO) S_c^T
    dk_g = tl.zeros([BC, BK], dtype=ACC)     # V Gx^T
    for v0 in tl.range(0, DV, BV, num_stages=1):  # no software pipelining: it would multiply the shared memory
        offs_v = v0 + tl.arange(0, BV)
        vmask = offs_v < DV
        smask = kmask[:, None] & vmask[None, :]
        v_mask = tmask[:, None] & vmask[None, :]
        v = _rows(V, v_base, t, sv_t, offs_v, v_mask, ACC)
        do = _rows(DO, v_base, t, sv_t, offs_v, v_mask, ACC)
        s = _neighbour_state(SA, S0, pid_bh, pid_c, NC, DK, DV, offs_k, offs_v, smask, -1, HAS_S0, ACC)
        gx = _neighbour_state(RA, DS, pid_bh, pid_c, NC, DK, DV, offs_k, offs_v, smask, 1, HAS_DS, ACC)
        dov += tl.dot(do, tl.trans(v), input_precision=PREC)
        dq_s += tl.dot(do * p[:, None], tl.trans(s), input_precision=PREC)
        dk_g += tl.dot(v, tl.trans(gx), input_precision=PREC)
    dovm = dov * m
    q = _rows(Q, q_base, t, sq_t, offs_k, qk_mask, ACC)
    k = _rows(K, q_base, t, sq_t, offs_k, qk_mask, ACC)
    dq = tl.dot(dovm, k, input_precision=PREC) + dq_s
    tl.store(DQ + q_base + t[:, None] * sq_t + offs_k[None, :], dq, mask=qk_mask)
    dk = tl.dot(tl.trans(dovm), q, input_precision=PREC) + gam[:, None] * dk_g
    tl.store(DK_ + q_base + t[:, None] * sq_t + offs_k[None, :], dk, mask=qk_mask)


@triton.jit
def _chunk_grad_decay_kernel(
    Q, K, V, D, DO, SA, S0, RA, DS, DD,
    T, H, DK, DV, NC, BH,
    sq_b, sq_h, sq_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t,
    HAS_S0: tl.constexpr, HAS_DS: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    """Value block ``pid_v``'s share of one chunk's per-step decay gradient, written to
    ``DD[pid_v]`` (a (dv blocks, B*H, T) buffer the launcher sums): every term is linear in
    the value dimension, ``w_s = q_s S_c do_s^T``, ``z_j = k_j Gx v_j^T``, ``<Gx, S_c>`` and
    ``(Q K^T) * dO V^T``. The key dimension is walked in ``BK``-wide blocks (``BK`` here is
    the block, not the whole head): what a program holds does not grow with the head."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_v = tl.program_id(2)
    b, h, offs_c, _, offs_v, _, vmask, t, tmask = _chunk_tile(pid_bh, pid_c, pid_v, H, T, DK, DV, BC, BK, BV)
    v_mask = tmask[:, None] & vmask[None, :]
    q_base = b * sq_b + h * sq_h
    v_base = b * sv_b + h * sv_h
    d_off = b * sd_b + h * sd_h
    v = _rows(V, v_base, t, sv_t, offs_v, v_mask, ACC)
    do = _rows(DO, v_base, t, sv_t, offs_v, v_mask, ACC)
    qk = tl.zeros([BC, BC], dtype=ACC)
    w = tl.zeros([BC], dtype=ACC)
    z = tl.zeros([BC], dtype=ACC)
    sg = tl.zeros([BK], dtype=ACC)
    for k0 in tl.range(0, DK, BK, num_stages=1):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < DK
        qk_mask = tmask[:, None] & kmask[None, :]
        smask = kmask[:, None] & vmask[None, :]
        s = _neighbour_state(SA, S0, pid_bh, pid_c, NC, DK, DV, offs_k, offs_v, smask, -1, HAS_S0, ACC)
        gx = _neighbour_state(RA, DS, pid_bh, pid_c, NC, DK, DV, offs_k, offs_v, smask, 1, HAS_DS, ACC)
        sg += tl.sum(gx * s, axis=1)
        q = _rows(Q, q_base, t, sq_t, offs_k, qk_mask, ACC)
        w += tl.sum(q * tl.dot(do, tl.trans(s), input_precision=PREC), axis=1)
        k = _rows(K, q_base, t, sq_t, offs_k, qk_mask, ACC)
        z += tl.sum(k * tl.dot(v, tl.trans(gx), input_precision=PREC), axis=1)
        qk += tl.dot(q, tl.trans(k), input_precision=PREC)
    m, p, gam, pe = _decay_factors(D, d_off, t, sd_t, tmask, offs_c, True, BC, ACC)
    ms, pp = _shifted_factors(D, d_off, t, sd_t, tmask, offs_c, BC, ACC)
    qkdov = qk * tl.dot(do, tl.trans(v), input_precision=PREC)
    dd = pp * tl.sum(m * w[:, None], axis=0) + pp * gam * tl.sum(sg, axis=0) + gam * tl.sum(ms * z[None, :], axis=1)
    dd += tl.sum(m * tl.dot(qkdov, tl.trans(ms), input_precision=PREC), axis=0)
    tl.store(DD + (pid_v * BH + pid_bh).to(tl.int64) * T + t, dd, mask=tmask)


@triton.jit
def _chunk_grad_v_kernel(
    Q, K, D, DO, RA, DS, DV_,
    T, H, DK, DV, NC,
    sq_b, sq_h, sq_t, sv_b, sv_h, sv_t, sd_b, sd_h, sd_t,
    HAS_DECAY: tl.constexpr, HAS_DS: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
):
    """``dV_c = ((Q K^T) * M)^T dO_c + Gam (K Gx_c)`` for value block ``pid_v`` of one chunk,
    ``Gx_c`` the gradient reaching the chunk's end (``RA``, edge ``DS``)."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_v = tl.program_id(2)
    b, h, offs_c, offs_k, offs_v, kmask, vmask, t, tmask = _chunk_tile(pid_bh, pid_c, pid_v, H, T, DK, DV, BC, BK, BV)
    qk_mask = tmask[:, None] & kmask[None, :]
    v_mask = tmask[:, None] & vmask[None, :]
    q_base = b * sq_b + h * sq_h
    v_base = b * sv_b + h * sv_h
    q = _rows(Q, q_base, t, sq_t, offs_k, qk_mask, ACC)
    k = _rows(K, q_base, t, sq_t, offs_k, qk_mask, ACC)
    m, p, gam, pe = _decay_factors(D, b * sd_b + h * sd_h, t, sd_t, tmask, offs_c, HAS_DECAY, BC, ACC)
    kqm = tl.dot(k, tl.trans(q), input_precision=PREC) * tl.trans(m)  # ((Q K^T) * M)^T
    do = _rows(DO, v_base, t, sv_t, offs_v, v_mask, ACC)
    gx = _neighbour_state(RA, DS, pid_bh, pid_c, NC, DK, DV, offs_k, offs_v, kmask[:, None] & vmask[None, :],
                          1, HAS_DS, ACC)
    dv = tl.dot(kqm, do, input_precision=PREC) + gam[:, None] * tl.dot(k, gx, input_precision=PREC)
    tl.store(DV_ + v_base + t[:, None] * sv_t + offs_v[None, :], dv, mask=v_mask)


def _block_c(chunk_size: int, dk: int, dtype: torch.dtype) -> int:
    """Forward kernel chunk: the requested chunk rounded to a power of two in [16, 64]; at most
    32 for heads wider than 64 and for float32/float64 inputs (their dots run on FMA units: at
    chunk 64 the output kernel spilled 128-168 B per thread on sm_90 at d = 64, at 32 none).
    Results do not depend on it."""
    if INTERPRETED:
        return min(32, pow2(chunk_size))
    wide = pow2(dk) > 64 or dtype in (torch.float32, torch.float64)
    return min(32 if wide else 64, pow2(chunk_size))


def _block_v(dv: int) -> int:
    """Forward dv block (a grid dimension). The interpreter uses the smallest block so that
    tests with dv > 16 cover several."""
    return 16 if INTERPRETED else min(pow2(dv), 64)


@dataclass(frozen=True)
class BackwardTiles:
    """Tile sizes of the three backward kernels; ``chunk`` is also the chunk of the state scans.

    Chosen from the ahead-of-time compile (``bench/bench_kernel_compile.py``, sm_90, 8 warps):
    at chunk 32 the dQ/dK kernel walking dv in 32-wide blocks, dV programs of 64 values and
    decay programs of 16 values walking dk in 32-wide blocks need no register spill for heads
    of 64 and 128 in float32, bfloat16 and float64 (155-250 registers). At chunk 64 every one of
    them spilled at d = 128, and the dQ/dK kernel at d = 64 too (float32, 240-2900 B per thread).
    """

    chunk: int
    qk_block_v: int
    v_block_v: int
    decay_block_k: int
    decay_block_v: int


def backward_tiles(chunk_size: int, dk: int, dv: int) -> BackwardTiles:
    """:class:`BackwardTiles` for heads of ``dk`` x ``dv``; the interpreter's smallest blocks
    let tests with dims above 16 walk several blocks of each kind."""
    chunk = min(32, pow2(chunk_size))
    if INTERPRETED:
        return BackwardTiles(chunk, 16, 16, 16, 16)
    return BackwardTiles(chunk, min(pow2(dv), 32), min(pow2(dv), 64), min(pow2(dk), 32), 16)


def _scan_chunks(x: torch.Tensor, y: torch.Tensor, decay: Optional[torch.Tensor], edge: Optional[torch.Tensor],
                 bc: int, acc: torch.dtype, *, reverse: bool) -> torch.Tensor:
    """Every chunk's increment ``(w X_c)^T Y_c`` scanned over chunks by ``S <- Pe_c S + increment``.

    Forward (``w = Gam``, X = K, Y = V): the state after every chunk, seeded with S0.
    Reverse (``w = P``, X = Q, Y = dO): the gradient entering every chunk's start, seeded with
    dS_final. Returns (B*H, NC, dk*dv) in ``acc``.
    """
    b, h, length, dk = x.shape
    dv = y.shape[-1]
    nc = triton.cdiv(length, bc)
    bk, bv = pow2(dk), _block_v(dv)
    inc = torch.empty((b * h, nc, dk, dv), dtype=acc, device=x.device)
    pe = torch.empty((b * h, nc), dtype=acc, device=x.device)
    d_t, d_s = _decay_args(decay, x)
    _chunk_outer_kernel[(nc, b * h, triton.cdiv(dv, bv))](
        x, y, d_t, inc, pe, length, h, dk, dv, nc,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2), *d_s,
        FROM_START=reverse, HAS_DECAY=decay is not None, BC=bc, BK=bk, BV=bv, ACC=tl_dtype(acc),
        PREC=dot_precision(x.dtype), num_warps=NUM_WARPS,
    )
    seed = None if edge is None else edge.reshape(b * h, dk * dv)
    flat = inc.view(b * h, nc, dk * dv)
    # in place: the increments become the states, one (B*H, NC, dk, dv) buffer instead of two
    return scan_triton(pe.unsqueeze(-1), flat, seed, reverse=reverse, out_dtype=acc, out=flat)


@serialized_launch
def lightning_fwd_triton(q, k, v, decay, s0, chunk_size: int, out_dtype: torch.dtype, acc: torch.dtype,
                         fused: Optional[bool] = None):
    """Forward. ``decay`` None or per step (B, H, T); returns (o in out_dtype, final state in acc).
    ``fused``: force the sequential fused kernel (True) or the chunk-parallel ones (False);
    None chooses (:func:`_fused_forward`). Results do not depend on it."""
    check_device(q)
    b, h, length, dk = q.shape
    dv = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty((b, h, length, dv), dtype=out_dtype, device=q.device)
    s0c = None if s0 is None else s0.contiguous()
    if b * h == 0 or length == 0:
        return o, _empty_sequence_state(s0c, (b, h, dk, dv), acc, q.device)
    if fused if fused is not None else _fused_forward(b, h, dk, dv, q.device):
        return o, run_fused_forward(q, k, v, decay, s0c, o, chunk_size, acc)
    bc = _block_c(chunk_size, dk, q.dtype)
    after = _scan_chunks(k, v, decay, s0c, bc, acc, reverse=False)
    nc = after.shape[1]
    d_t, d_s = _decay_args(decay, q)
    bk, bv = pow2(dk), _block_v(dv)
    _chunk_output_kernel[(nc, b * h, triton.cdiv(dv, bv))](
        q, k, v, d_t, after, s0c if s0c is not None else after, o, length, h, dk, dv, nc,
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), *d_s,
        o.stride(0), o.stride(1), o.stride(2),
        HAS_DECAY=decay is not None, HAS_S0=s0c is not None, BC=bc, BK=bk, BV=bv,
        ACC=tl_dtype(acc), PREC=dot_precision(q.dtype), num_warps=NUM_WARPS,
    )
    # A copy, not a view: a view would keep every chunk's state alive with the output.
    final = after[:, -1].reshape(b, h, dk, dv).clone()
    return o, final


@serialized_launch
def lightning_bwd_triton(q, k, v, decay, s0, do, ds, chunk_size: int, acc: torch.dtype,
                         fused: Optional[bool] = None):
    """Backward. Returns (dq, dk, dv in the inputs' dtypes, dd per step (B, H, T) or None, dS0 in acc).
    ``fused``: force the two sequential sweeps (True, :func:`.lightning_fused.run_fused_backward`)
    or the chunk-parallel kernels (False); None chooses (:func:`.lightning_fused._fused_backward`).
    Results do not depend on it."""
    check_device(q)
    b, h, length, dk = q.shape
    dv = v.shape[-1]
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    do = do.to(v.dtype).contiguous()
    dq, dk_, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dd = None if decay is None else torch.empty((b, h, length), dtype=acc, device=q.device)
    s0c = None if s0 is None else s0.contiguous()
    dsc = None if ds is None else ds.contiguous()
    if b * h == 0 or length == 0:
        return dq, dk_, dv_, dd, _empty_sequence_state(dsc, (b, h, dk, dv), acc, q.device)
    if fused if fused is not None else _fused_backward(b, h, dk, dv, q.device, q.dtype, decay is not None):
        return dq, dk_, dv_, dd, run_fused_backward(q, k, v, decay, s0c, do, dsc, chunk_size, acc, dq, dk_, dv_, dd)
    tiles = backward_tiles(chunk_size, dk, dv)
    bc, bk = tiles.chunk, pow2(dk)
    after = _scan_chunks(k, v, decay, s0c, bc, acc, reverse=False)
    grads = _scan_chunks(q, do, decay, dsc, bc, acc, reverse=True)
    nc = after.shape[1]
    d_t, d_s = _decay_args(decay, q)
    strides = (q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), *d_s)
    states = (after, s0c if s0c is not None else after, grads, dsc if dsc is not None else grads)
    consts = dict(BC=bc, ACC=tl_dtype(acc), PREC=dot_precision(q.dtype), num_warps=NUM_WARPS)
    _chunk_grad_qk_kernel[(nc, b * h)](
        q, k, v, d_t, do, *states, dq, dk_, length, h, dk, dv, nc, *strides,
        HAS_DECAY=decay is not None, HAS_S0=s0c is not None, HAS_DS=dsc is not None,
        BK=bk, BV=tiles.qk_block_v, **consts,
    )
    _chunk_grad_v_kernel[(nc, b * h, triton.cdiv(dv, tiles.v_block_v))](
        q, k, d_t, do, *states[2:], dv_, length, h, dk, dv, nc, *strides,
        HAS_DECAY=decay is not None, HAS_DS=dsc is not None, BK=bk, BV=tiles.v_block_v, **consts,
    )
    if decay is not None:
        nv = triton.cdiv(dv, tiles.decay_block_v)
        parts = dd if nv == 1 else torch.empty((nv, b, h, length), dtype=acc, device=q.device)
        _chunk_grad_decay_kernel[(nc, b * h, nv)](
            q, k, v, d_t, do, *states, parts, length, h, dk, dv, nc, b * h, *strides,
            HAS_S0=s0c is not None, HAS_DS=dsc is not None, BK=tiles.decay_block_k, BV=tiles.decay_block_v, **consts,
        )
        if nv > 1:
            torch.sum(parts, dim=0, out=dd)
    ds0 = grads[:, 0].reshape(b, h, dk, dv).clone()
    return dq, dk_, dv_, dd, ds0
