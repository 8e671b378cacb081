"""Fused adjoint-shard kernel for ``h_t = a_t h_{t-1} + u_t`` (see :mod:`gradshard.kernels.adjoint`).

One program owns ``BLOCK_N`` state channels of one batch row and the whole shard:

* pass 1 walks the shard forward in tiles of ``BLOCK_T`` and keeps only the state entering each
  tile (``S / BLOCK_T`` checkpoints; ``h`` itself is never written to global memory);
* pass 2 walks the tiles backwards. Per tile it rebuilds ``h_{t-1}`` from the tile's checkpoint
  (an associative scan over the inputs shifted by one step, seeded with the checkpoint), runs the
  adjoint ``lam_t = g_t + a_{t+1} lam_{t+1}`` as a forward scan over time-reversed rows (carry =
  ``lam`` of the next tile, initially ``lam_carry``), and writes ``grad_a = lam h_{t-1}`` and
  ``grad_u = lam``. Finally ``grad_h0 = a_1 lam_1``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..backend import accumulation_dtype
from .layout import INTERPRETED, check_device, serialized_launch, state_strides, tl_dtype
from .scan import affine_combine


@triton.jit
def _adjoint_shard_kernel(
    A, U, G, H0, LC, GA, GU, GH0, CKPT,
    T, N, N1,
    sa_b, sa_t, sa_n0, sa_n1, su_b, su_t, sck_b,
    HAS_H0: tl.constexpr, HAS_LC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    a_n = (n // N1).to(tl.int64) * sa_n0 + (n % N1).to(tl.int64) * sa_n1
    a_base = A + pid_b * sa_b + a_n[None, :]
    u_base = pid_b * su_b + n[None, :]
    rows = tl.arange(0, BLOCK_T)
    last = (rows == BLOCK_T - 1)[:, None]
    first = (rows == 0)[:, None]
    n_tiles = tl.cdiv(T, BLOCK_T)
    if HAS_H0:
        h = tl.load(H0 + pid_b * N + n, mask=nmask, other=0.0).to(ACC)
    else:
        h = tl.zeros([BLOCK_N], dtype=ACC)
    # Pass 1: checkpoints of the state entering every tile.
    for k in range(0, n_tiles):
        tl.store(CKPT + pid_b * sck_b + k * N + n, h, mask=nmask)
        t = (k * BLOCK_T + rows).to(tl.int64)
        m2 = (t < T)[:, None] & nmask[None, :]
        a = tl.load(a_base + t[:, None] * sa_t, mask=m2, other=1.0).to(ACC)
        u = tl.load(U + u_base + t[:, None] * su_t, mask=m2, other=0.0).to(ACC)
        a_cum, u_cum = tl.associative_scan((a, u), 0, affine_combine)
        h = tl.sum(tl.where(last, a_cum * h[None, :] + u_cum, 0.0), axis=0)
    # Pass 2 reads checkpoints that other threads of this program may have stored (the store and
    # the load use different layouts): a CTA barrier makes those global writes visible.
    tl.debug_barrier()
    # Pass 2: tiles in reverse; rows of a tile in reversed time order for the adjoint scan.
    if HAS_LC:
        lam = tl.load(LC + pid_b * N + n, mask=nmask, other=0.0).to(ACC)
    else:
        lam = tl.zeros([BLOCK_N], dtype=ACC)
    for r in range(0, n_tiles):
        k = n_tiles - 1 - r
        ckpt = tl.load(CKPT + pid_b * sck_b + k * N + n, mask=nmask, other=0.0)
        # h_{t-1} in forward row order: scan of (a_{t-1}, u_{t-1}) seeded with (0, ckpt) in row 0.
        tf = (k * BLOCK_T + rows).to(tl.int64)
        mf = ((tf < T) & (rows > 0))[:, None] & nmask[None, :]
        ap = tl.load(a_base + (tf - 1)[:, None] * sa_t, mask=mf, other=1.0).to(ACC)
        up = tl.load(U + u_base + (tf - 1)[:, None] * su_t, mask=mf, other=0.0).to(ACC)
        ap = tl.where(first, 0.0, ap)
        up = tl.where(first, ckpt[None, :], up)
        _, h_prev = tl.associative_scan((ap, up), 0, affine_combine)
        h_prev = tl.flip(h_prev, 0)
        # lam in reversed rows: row i <-> t = k*BLOCK_T + BLOCK_T-1-i (rows past T are identities).
        tr = (k * BLOCK_T + BLOCK_T - 1 - rows).to(tl.int64)
        valid = (tr < T)[:, None] & nmask[None, :]
        nxt = (tr + 1 < T)[:, None] & nmask[None, :]
        an = tl.load(a_base + (tr + 1)[:, None] * sa_t, mask=nxt, other=1.0).to(ACC)
        g = tl.load(G + u_base + tr[:, None] * su_t, mask=valid, other=0.0).to(ACC)
        a_cum, g_cum = tl.associative_scan((an, g), 0, affine_combine)
        lam_rows = a_cum * lam[None, :] + g_cum
        tl.store(GU + u_base + tr[:, None] * su_t, lam_rows, mask=valid)
        tl.store(GA + u_base + tr[:, None] * su_t, lam_rows * h_prev, mask=valid)
        lam = tl.sum(tl.where(last, lam_rows, 0.0), axis=0)
    a1 = tl.load(A + pid_b * sa_b + a_n, mask=nmask, other=0.0).to(ACC)
    tl.store(GH0 + pid_b * N + n, a1 * lam, mask=nmask)


def _adjoint_tiles(batch: int, n: int, device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_N, num_warps, num_stages)``: one program walks a whole shard for its
    channels, so parallelism is ``batch x channel blocks`` only: narrow 16-channel tiles make the
    most programs. From the sweep on an H200 (``bench/bench_scan_tiles.py --kernel adjoint``,
    float32): 64 x 16 tiles, 2 warps with at least 2 programs per SM (4 x 16K x 2048: 29% of HBM
    bandwidth, was 16% with 32 x 64), else 4 warps (1 x 64K x 2048: 11%, was 5%). Tiny tiles under
    the interpreter (it scans element by element)."""
    if INTERPRETED:
        return 8, min(16, triton.next_power_of_2(n)), 4, 3
    block_n = min(16, triton.next_power_of_2(max(1, n)))
    if device.type != "cuda":  # launches recorded on CPU tensors for ahead-of-time compilation
        return 64, block_n, 2, 3
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    warps = 2 if batch * triton.cdiv(n, block_n) >= 2 * sms else 4
    return 64, block_n, warps, 3


@serialized_launch
def adjoint_shard_triton(
    a: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    h0: Optional[torch.Tensor],
    lam_carry: Optional[torch.Tensor],
    out_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    tiles: Optional[tuple[int, int, int, int]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`gradshard.kernels.adjoint.adjoint_shard_torch`.

    ``tiles``: ``(BLOCK_T, BLOCK_N, num_warps, num_stages)`` instead of :func:`_adjoint_tiles`'s
    (for tuning: ``bench/bench_scan_tiles.py --kernel adjoint``)."""
    check_device(u)
    da_t, du_t, dh_t = out_dtypes
    acc = accumulation_dtype(torch.promote_types(torch.promote_types(a.dtype, u.dtype), g.dtype))
    batch, length = u.shape[0], u.shape[1]
    n = 1
    for s in u.shape[2:]:
        n *= int(s)
    grad_h0 = torch.zeros((batch, *u.shape[2:]), dtype=dh_t, device=u.device)
    if length == 0 or batch == 0 or n == 0:
        return torch.zeros(a.shape, dtype=da_t, device=u.device), torch.zeros_like(u, dtype=du_t), grad_h0
    broadcast_a = tuple(a.shape) != tuple(u.shape)
    grad_a = torch.empty(u.shape, dtype=acc if broadcast_a else da_t, device=u.device)
    grad_u = torch.empty(u.shape, dtype=du_t, device=u.device)
    u3 = u.reshape(batch, length, n).contiguous()
    g3 = g.reshape(batch, length, n).contiguous()
    sa = state_strides(a, u.shape)
    h0_2 = None if h0 is None else h0.reshape(batch, n).contiguous()
    lc_2 = None if lam_carry is None else lam_carry.reshape(batch, n).contiguous()
    block_t, block_n, warps, stages = tiles if tiles is not None else _adjoint_tiles(batch, n, u.device)
    n_tiles = triton.cdiv(length, block_t)
    ckpt = torch.empty((batch, n_tiles, n), dtype=acc, device=u.device)
    gh = grad_h0.view(batch, n) if dh_t == acc else torch.empty((batch, n), dtype=acc, device=u.device)
    grid = (triton.cdiv(n, block_n), batch)
    _adjoint_shard_kernel[grid](
        sa.tensor, u3, g3, h0_2 if h0_2 is not None else u3, lc_2 if lc_2 is not None else u3,
        grad_a, grad_u, gh, ckpt, length, n, sa.inner,
        sa.batch, sa.time, sa.outer_stride, sa.inner_stride, u3.stride(0), u3.stride(1), ckpt.stride(0),
        HAS_H0=h0_2 is not None, HAS_LC=lc_2 is not None, BLOCK_T=block_t, BLOCK_N=block_n, ACC=tl_dtype(acc),
        num_warps=warps, num_stages=stages,
    )
    if gh.data_ptr() != grad_h0.data_ptr():
        grad_h0.view(batch, n).copy_(gh)
    if broadcast_a:
        grad_a = grad_a.sum_to_size(a.shape).to(da_t)
    return grad_a, grad_u, grad_h0
