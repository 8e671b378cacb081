"""Triton diagonal linear scan, forward and reverse, fp32 accumulation, in three launch forms.

Inside a tile of ``BLOCK_T`` steps x ``BLOCK_N`` channels the recurrence is a
``tl.associative_scan`` with the affine combine ``(a1, u1) . (a2, u2) = (a1 a2, a2 u1 + u2)``.
The reverse scan loads tiles in reversed time order and runs the same forward combine (no
reliance on ``associative_scan(reverse=True)`` semantics). The forms (:func:`_tiles` picks one):

* *one pass* (``batch x channel blocks`` fills the GPU): one program per channel block and batch
  row walks the whole sequence tile by tile, the last row of a tile carrying into the next;
* *look-back* (too few channel blocks): one program per tile; each publishes its tile's
  aggregate map, composes its predecessors' maps until one has published its inclusive state
  (decoupled look-back), then writes its states. a and u are read once, h written once;
* *chunked* (a time chunk forced by the caller): a ``SUMMARY`` launch gives every chunk's local
  end state and product of ``a``, the summaries are scanned (recursive call), and a final launch
  rescans every chunk from its incoming state (a and u read twice).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..backend import accumulation_dtype
from .layout import INTERPRETED, check_device, serialized_launch, state_strides, tl_dtype


@triton.jit
def affine_combine(a1, u1, a2, u2):
    """Compose two affine maps h -> a h + u (first (a1, u1), then (a2, u2))."""
    return a1 * a2, a2 * u1 + u2


@triton.jit
def _tile_rows(k0, c_start, c_len, rows, nmask, REVERSE: tl.constexpr):
    """Time index and mask of the tile starting ``k0`` steps into the chunk (reversed for REVERSE)."""
    i = k0 + rows
    if REVERSE:
        t = (c_start + c_len - 1 - i).to(tl.int64)
    else:
        t = (c_start + i).to(tl.int64)
    return t, (i < c_len)[:, None] & nmask[None, :]


@triton.jit
def _scan_chunk_kernel(
    A, U, CARRY, OUT, SUM_H, SUM_P,
    T, N, N1, CHUNK,
    sa_b, sa_t, sa_n0, sa_n1,
    su_b, su_t, sc_b, sc_c, so_b, so_t, ss_b, ss_c,
    REVERSE: tl.constexpr, HAS_CARRY: tl.constexpr, SUMMARY: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    a_ptr = A + pid_b * sa_b + ((n // N1).to(tl.int64) * sa_n0 + (n % N1).to(tl.int64) * sa_n1)[None, :]
    u_ptr = U + pid_b * su_b + n[None, :]
    c_start = pid_c * CHUNK
    c_len = tl.minimum(CHUNK, T - c_start)
    if HAS_CARRY:
        h = tl.load(CARRY + pid_b * sc_b + pid_c * sc_c + n, mask=nmask, other=0.0).to(ACC)
    else:
        h = tl.zeros([BLOCK_N], dtype=ACC)
    prod = tl.full([BLOCK_N], 1.0, ACC)
    rows = tl.arange(0, BLOCK_T)
    last = (rows == BLOCK_T - 1)[:, None]
    if PREFETCH:  # registers hold the next tile while this one is scanned: its load latency is hidden
        t, m2 = _tile_rows(0, c_start, c_len, rows, nmask, REVERSE)
        a = tl.load(a_ptr + t[:, None] * sa_t, mask=m2, other=1.0)
        u = tl.load(u_ptr + t[:, None] * su_t, mask=m2, other=0.0)
    for k0 in range(0, c_len, BLOCK_T):
        if not PREFETCH:
            t, m2 = _tile_rows(k0, c_start, c_len, rows, nmask, REVERSE)
            a = tl.load(a_ptr + t[:, None] * sa_t, mask=m2, other=1.0)
            u = tl.load(u_ptr + t[:, None] * su_t, mask=m2, other=0.0)
        # Padding rows are the identity map (a = 1, u = 0): the last row is the last valid state.
        a_cum, u_cum = tl.associative_scan((a.to(ACC), u.to(ACC)), 0, affine_combine)
        hs = a_cum * h[None, :] + u_cum
        if SUMMARY:
            prod = prod * tl.sum(tl.where(last, a_cum, 0.0), axis=0)
        else:
            tl.store(OUT + pid_b * so_b + t[:, None] * so_t + n[None, :], hs, mask=m2)
        h = tl.sum(tl.where(last, hs, 0.0), axis=0)
        if PREFETCH:
            t, m2 = _tile_rows(k0 + BLOCK_T, c_start, c_len, rows, nmask, REVERSE)
            a = tl.load(a_ptr + t[:, None] * sa_t, mask=m2, other=1.0)
            u = tl.load(u_ptr + t[:, None] * su_t, mask=m2, other=0.0)
    if SUMMARY:
        tl.store(SUM_H + pid_b * ss_b + pid_c * ss_c + n, h, mask=nmask)
        tl.store(SUM_P + pid_b * ss_b + pid_c * ss_c + n, prod, mask=nmask)


class Tiles(NamedTuple):
    """A launch configuration of the scan kernel: tile shape, warps, software pipelining."""

    block_t: int
    block_n: int
    warps: int
    stages: int = 3  # Triton's loop pipelining depth (``num_stages``; 3 is Triton's CUDA default)
    prefetch: bool = False  # load the next tile into registers before scanning this one
    lookback: bool = False  # one tile per program, decoupled look-back (unless a time chunk is forced)


@triton.jit
def _scan_lookback_kernel(
    A, U, H0, OUT, AGG_A, AGG_U, INCL, FLAGS, TICKET,
    T, N, N1, N_TILES, N_BLOCKS, BATCH,
    sa_b, sa_t, sa_n0, sa_n1, su_b, su_t, so_b, so_t,
    REVERSE: tl.constexpr, HAS_H0: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
):
    """One pass, one tile per program, decoupled look-back (Merrill & Garland 2016).

    A ticket taken at start orders programs by tile (tile-major), so every program's
    predecessors have started and the spin-waits below cannot deadlock. A program scans its
    tile from zero, publishes the tile's aggregate map (flag 1), walks back over its
    predecessors' aggregates until one has published its inclusive state (flag 2), then writes
    its states and publishes its own inclusive state. a and u are read once and h written once.
    """
    ticket = tl.atomic_add(TICKET, 1)
    k = ticket // (N_BLOCKS * BATCH)
    rest = ticket % (N_BLOCKS * BATCH)
    pid_b = (rest // N_BLOCKS).to(tl.int64)
    pid_n = rest % N_BLOCKS
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    a_ptr = A + pid_b * sa_b + ((n // N1).to(tl.int64) * sa_n0 + (n % N1).to(tl.int64) * sa_n1)[None, :]
    u_ptr = U + pid_b * su_b + n[None, :]
    rows = tl.arange(0, BLOCK_T)
    last = (rows == BLOCK_T - 1)[:, None]
    t, m2 = _tile_rows(k * BLOCK_T, 0, T, rows, nmask, REVERSE)
    a = tl.load(a_ptr + t[:, None] * sa_t, mask=m2, other=1.0).to(ACC)
    u = tl.load(u_ptr + t[:, None] * su_t, mask=m2, other=0.0).to(ACC)
    a_cum, u_cum = tl.associative_scan((a, u), 0, affine_combine)
    rows_of = pid_b * N_TILES * N + n  # row k of a (BATCH, N_TILES, N) summary: + k * N
    flags_of = FLAGS + pid_b * N_TILES * N_BLOCKS + pid_n  # tile k's flag: + k * N_BLOCKS
    tl.store(AGG_A + rows_of + k * N, tl.sum(tl.where(last, a_cum, 0.0), axis=0), mask=nmask)
    tl.store(AGG_U + rows_of + k * N, tl.sum(tl.where(last, u_cum, 0.0), axis=0), mask=nmask)
    tl.debug_barrier()  # every thread's summary store before the flag that publishes it
    tl.atomic_xchg(flags_of + k * N_BLOCKS, 1, sem="release")
    # Compose predecessors' maps, latest first, into h -> acc_a h + acc_u (the map from the
    # state before tile j to the state entering tile k), until an inclusive state is found.
    acc_a = tl.full([BLOCK_N], 1.0, ACC)
    acc_u = tl.zeros([BLOCK_N], dtype=ACC)
    found = 0
    j = k - 1
    while j >= 0:
        flag = tl.atomic_add(flags_of + j * N_BLOCKS, 0, sem="acquire")
        if flag == 2:
            p = tl.load(INCL + rows_of + j * N, mask=nmask, other=0.0, volatile=True)
            acc_u = acc_a * p + acc_u
            found = 1
            j = -1
        elif flag == 1:
            agg_a = tl.load(AGG_A + rows_of + j * N, mask=nmask, other=1.0, volatile=True)
            agg_u = tl.load(AGG_U + rows_of + j * N, mask=nmask, other=0.0, volatile=True)
            acc_u = acc_a * agg_u + acc_u
            acc_a = acc_a * agg_a
            j = j - 1
    h = acc_u
    if HAS_H0:
        if found == 0:
            h = acc_a * tl.load(H0 + pid_b * N + n, mask=nmask, other=0.0).to(ACC) + acc_u
    hs = a_cum * h[None, :] + u_cum
    tl.store(OUT + pid_b * so_b + t[:, None] * so_t + n[None, :], hs, mask=m2)
    tl.store(INCL + rows_of + k * N, tl.sum(tl.where(last, hs, 0.0), axis=0), mask=nmask)
    tl.debug_barrier()
    tl.atomic_xchg(flags_of + k * N_BLOCKS, 2, sem="release")


def _tiles(batch: int, n: int, length: int, device: torch.device, itemsize: int = 4) -> tuple[Tiles, int]:
    """``(tiles, time chunk)`` for a ``(batch, length, n)`` scan of ``itemsize``-byte inputs.

    From the tile sweeps on an H200 (``bench/bench_scan_tiles.py``, RESULTS.md "Kernels"): with at
    least 1.5 programs per SM, one pass of tall 128 x 32 tiles with the next tile prefetched is
    fastest (4 x 16K x 2048: 68% of HBM bandwidth in float32, 34% in bfloat16); with fewer, the
    one-pass look-back kernel over 64-step tiles (1 x 64K x 2048: 60% float32 with 64 channels per
    tile, 31% bfloat16 with 32), against 48% / 24% for the two-pass chunked scan, which reads a and
    u twice. ``num_stages`` made no measurable difference (the loop's loads feed a scan, not a
    dot). Tiny tiles under the interpreter (it scans element by element); the one-pass tiles for
    launches recorded on CPU tensors (:mod:`.aot`).
    """
    if INTERPRETED:
        return Tiles(8, min(16, triton.next_power_of_2(max(1, n))), 4), length
    block_n = min(32, max(16, triton.next_power_of_2(max(1, n))))
    # float64: 64-step tiles, no prefetch (128 steps, or a prefetched tile, spill registers on sm_90)
    one_pass = Tiles(128, block_n, 4, prefetch=True) if itemsize < 8 else Tiles(64, block_n, 4)
    if device.type != "cuda":  # launches recorded on CPU tensors for ahead-of-time compilation
        return one_pass, length
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if 2 * batch * triton.cdiv(n, block_n) >= 3 * sms:
        return one_pass, length
    block_n = min(64 if itemsize >= 4 else 32, max(16, triton.next_power_of_2(max(1, n))))
    return Tiles(64, block_n, 2, lookback=True), length


def _default_chunk(batch: int, n: int, length: int, block_t: int, block_n: int, device: torch.device) -> int:
    """Time-chunk length: one chunk unless batch x channel blocks leave the GPU underused."""
    programs = batch * triton.cdiv(n, block_n)
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= target:
        return length
    chunks = max(1, target // programs)
    chunk = triton.cdiv(length, chunks)
    return max(8 * block_t, triton.cdiv(chunk, block_t) * block_t)


@serialized_launch
def scan_triton(
    a: torch.Tensor,
    u: torch.Tensor,
    h0: Optional[torch.Tensor],
    reverse: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    chunk: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    tiles: Optional[Tiles] = None,
) -> torch.Tensor:
    """Same contract as :func:`gradshard.kernels.scan_torch.scan_torch`; ``chunk`` forces the time chunk.

    ``out``: a contiguous ``u``-shaped tensor of ``out_dtype`` to write into; it may be ``u``
    itself (every program reads a tile of ``u`` before writing the same tile of ``out``).
    ``tiles``: a :class:`Tiles` (or its leading fields as a tuple) instead of :func:`_tiles`'s
    (for tuning: ``bench/bench_scan_tiles.py``).
    """
    check_device(u)
    acc = accumulation_dtype(torch.promote_types(a.dtype, u.dtype))
    out_dtype = acc if out_dtype is None else out_dtype
    batch, length = u.shape[0], u.shape[1]
    n = 1
    for s in u.shape[2:]:
        n *= int(s)
    if out is None:
        out = torch.empty(u.shape, dtype=out_dtype, device=u.device)
    elif out.shape != u.shape or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"scan_triton: out must be a contiguous {tuple(u.shape)} {out_dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}{'' if out.is_contiguous() else ' (not contiguous)'}.")
    if length == 0 or batch == 0 or n == 0:
        return out
    u3 = u.reshape(batch, length, n).contiguous()
    o3 = out.view(batch, length, n)
    sa = state_strides(a, u.shape)
    h0_2 = None if h0 is None else h0.reshape(batch, n).contiguous()
    cfg, own_chunk = _tiles(batch, n, length, u.device, min(a.element_size(), u.element_size()))
    if tiles is not None:
        cfg = Tiles(*tiles)
        own_chunk = length if INTERPRETED or not u.is_cuda else _default_chunk(batch, n, length, cfg.block_t,
                                                                                cfg.block_n, u.device)
    if cfg.lookback and chunk is None:
        _launch_lookback(sa, u3, h0_2, o3, cfg, acc, reverse)
        return out
    if chunk is None:
        chunk = own_chunk
    chunk = max(1, min(int(chunk), length))
    n_chunks = triton.cdiv(length, chunk)
    grid = (triton.cdiv(n, cfg.block_n), n_chunks, batch)
    common = dict(BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, ACC=tl_dtype(acc), REVERSE=bool(reverse),
                  PREFETCH=cfg.prefetch, num_warps=cfg.warps, num_stages=cfg.stages)
    a_args = (length, n, sa.inner, chunk, sa.batch, sa.time, sa.outer_stride, sa.inner_stride)
    if n_chunks == 1:
        carry = h0_2 if h0_2 is not None else u3
        _scan_chunk_kernel[grid](
            sa.tensor, u3, carry, o3, o3, o3, *a_args, u3.stride(0), u3.stride(1), n, 0,
            o3.stride(0), o3.stride(1), 0, 0, HAS_CARRY=h0_2 is not None, SUMMARY=False, **common,
        )
        return out
    sum_h = torch.empty((batch, n_chunks, n), dtype=acc, device=u.device)
    sum_p = torch.empty_like(sum_h)
    _scan_chunk_kernel[grid](
        sa.tensor, u3, u3, o3, sum_h, sum_p, *a_args, u3.stride(0), u3.stride(1), 0, 0,
        o3.stride(0), o3.stride(1), sum_h.stride(0), sum_h.stride(1),
        HAS_CARRY=False, SUMMARY=True, **common,
    )
    ends = scan_triton(sum_p, sum_h, h0_2, reverse=reverse, out_dtype=acc, tiles=tiles)
    edge = torch.zeros_like(ends[:, :1]) if h0_2 is None else h0_2.to(acc).unsqueeze(1)
    carries = torch.cat([ends[:, 1:], edge], 1) if reverse else torch.cat([edge, ends[:, :-1]], 1)
    carries = carries.contiguous()
    _scan_chunk_kernel[grid](
        sa.tensor, u3, carries, o3, o3, o3, *a_args, u3.stride(0), u3.stride(1),
        carries.stride(0), carries.stride(1), o3.stride(0), o3.stride(1), 0, 0,
        HAS_CARRY=True, SUMMARY=False, **common,
    )
    return out


def _launch_lookback(sa, u3: torch.Tensor, h0_2: Optional[torch.Tensor], o3: torch.Tensor, cfg: Tiles,
                     acc: torch.dtype, reverse: bool) -> None:
    """One launch of :func:`_scan_lookback_kernel` over every (tile, channel block, batch row)."""
    batch, length, n = u3.shape
    n_tiles, n_blocks = triton.cdiv(length, cfg.block_t), triton.cdiv(n, cfg.block_n)
    agg_a = torch.empty((batch, n_tiles, n), dtype=acc, device=u3.device)
    agg_u, incl = torch.empty_like(agg_a), torch.empty_like(agg_a)
    flags = torch.zeros(batch * n_tiles * n_blocks + 1, dtype=torch.int32, device=u3.device)
    _scan_lookback_kernel[(batch * n_tiles * n_blocks,)](
        sa.tensor, u3, h0_2 if h0_2 is not None else u3, o3, agg_a, agg_u, incl, flags, flags[-1:],
        length, n, sa.inner, n_tiles, n_blocks, batch,
        sa.batch, sa.time, sa.outer_stride, sa.inner_stride, u3.stride(0), u3.stride(1), o3.stride(0), o3.stride(1),
        REVERSE=bool(reverse), HAS_H0=h0_2 is not None, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
        ACC=tl_dtype(acc), num_warps=cfg.warps, num_stages=cfg.stages,
    )
