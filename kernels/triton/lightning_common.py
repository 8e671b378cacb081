"""Device helpers shared by the chunk-parallel (:mod:`.lightning`) and the fused sequential
(:mod:`.lightning_fused`) lightning attention kernels: a chunk's decay factors and tiles.

Notation of :mod:`gradshard.kernels.lightning_torch` (M, Ms, P, Pp, Gam, Pe). The decay factors
are built in registers by cumulative products (``tl.cumprod``), never by dividing or by
exponentiating log-decay differences, so a decay of exactly 0 is exact.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

#: Warps per program (every lightning kernel): with 4 the float32 kernels spilled at tile sizes
#: that compile without spills at 8 (bench/bench_kernel_compile.py).
NUM_WARPS = 8


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
def _chunk_tile(pid_bh, pid_c, pid_v, H, T, DK, DV, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """(batch, head, chunk rows, key cols, value cols of block ``pid_v``, their masks, steps, step mask)."""
    offs_c = tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    t = (pid_c * BC + offs_c).to(tl.int64)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    return b, h, offs_c, offs_k, offs_v, offs_k < DK, offs_v < DV, t, t < T


@triton.jit
def _rows(X, base, t, s_t, offs, mask, ACC: tl.constexpr):
    """The (steps ``t``) x (columns ``offs``) tile of a (.., T, d) tensor at ``base``, in ``ACC``."""
    return tl.load(X + base + t[:, None] * s_t + offs[None, :], mask=mask, other=0.0).to(ACC)


def _decay_args(decay: Optional[torch.Tensor], like: torch.Tensor):
    """(tensor, strides) of a per-step decay view (B, H, T); stride-0 views of (H,) stay cheap."""
    if decay is None:
        return like, (0, 0, 0)
    return decay, tuple(decay.stride())


def _empty_sequence_state(edge: Optional[torch.Tensor], shape: tuple[int, ...], acc: torch.dtype,
                          device: torch.device) -> torch.Tensor:
    """T = 0: the state passes through unchanged (or is 0)."""
    return torch.zeros(shape, dtype=acc, device=device) if edge is None else edge.to(acc).clone()
