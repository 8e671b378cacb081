"""Truncated adjoint states in O(T), streamed over time shards in reverse.

``plan="truncated_adjoint"`` with window ``W`` (docs/DESIGN.md; paper eq. 7) uses, for 0-based
steps ``i < T``::

    lam_i = sum_{t=i}^{min(i+W-1, T-1)} (prod_{j=i+1}^{t} a_j) g_t       (dense: A_j^T, right to left)

Blockwise evaluation (blocks ``[bW, (b+1)W)``, global alignment; ``i`` in block ``b`` whose
last step is ``E`` and the next block starts at ``nb = E + 1``)::

    lam_i = S_i + R_i * F^{nb}_{min(i+W-1, T-1)}      (only the first term when i = bW or nb >= T)
    S_i   = g_i + a_{i+1} S_{i+1}   inside the block,  S_E = g_E          (suffix scan)
    R_i   = a_{i+1} R_{i+1}         inside the block,  R_E = 1            (reverse cumprod)
    F^{nb}_k = sum_{t=nb}^{k} (prod_{j=nb}^{t} a_j) g_t                   (forward over the next block)

No cumulative product is ever divided (``a`` may be tiny or zero). :class:`TruncatedSweep`
receives shards right to left; it keeps the ``(a, g)`` of the next ``W-1`` steps as a list of
chunks, the ``S``/``R`` carries at the shard's right edge and ``F`` of the first block that
starts at or after it. Every ``S``, ``R`` and ``F`` value is computed once: O(T) work for any
``W``, O(W + shard) memory. ``W >= T`` gives the exact adjoint.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["TruncatedSweep", "truncated_lambda"]


def _expand_time(x: Tensor, length: int) -> Tensor:
    return x.expand(x.shape[0], length, *x.shape[2:]) if x.shape[1] == 1 and length != 1 else x


class TruncatedSweep:
    """Truncated adjoint ``lam`` for shards given right to left (see the module doc).

    ``kind``: ``"diagonal"`` (``a`` broadcasts to ``g``; ``None`` means 1) or ``"dense"``
    (``a``: ``(B, S, N, N)``, ``g``: ``(B, S, N, P)``).
    """

    def __init__(self, kind: str, window: int, length: int) -> None:
        if window < 1:
            raise ValueError(f"truncated adjoint: window must be >= 1, got {window}")
        self.kind, self.W, self.T = kind, int(window), int(length)
        self._next = self.T  # start of the last shard processed
        self._chunks: list[tuple[int, Optional[Tensor], Tensor]] = []  # (start, a, g), increasing
        self._carry_S: Optional[Tensor] = None
        self._carry_R: Optional[Tensor] = None
        self._cache: Optional[tuple[int, Tensor]] = None  # (block start, F over its first W-1 steps)

    # ------------------------------------------------------------------ helpers

    def _range(self, start: int, stop: int, a: Optional[Tensor], g: Tensor, s: int) -> tuple[Optional[Tensor], Tensor]:
        """``(a, g)`` over ``[start, stop)`` from the current shard (at ``s``) and the chunk list."""
        pieces_a: list[Tensor] = []
        pieces_g: list[Tensor] = []
        for c_start, ca, cg in [(s, a, g), *self._chunks]:
            c_len = cg.shape[1]
            lo, hi = max(start, c_start), min(stop, c_start + c_len)
            if lo >= hi:
                continue
            if ca is not None:
                pieces_a.append(_expand_time(ca, c_len)[:, lo - c_start:hi - c_start])
            pieces_g.append(cg[:, lo - c_start:hi - c_start])
        ga = torch.cat(pieces_g, 1) if len(pieces_g) > 1 else pieces_g[0]
        aa = None if a is None else (torch.cat(pieces_a, 1) if len(pieces_a) > 1 else pieces_a[0])
        return aa, ga

    def _a_after(self, e: int, like: Tensor) -> Tensor:
        """``a_e`` (first step after the shard), ones past the end."""
        if self._chunks and self._chunks[0][1] is not None and e < self.T:
            ca = self._chunks[0][1]
            return ca[:, :1]
        return torch.ones_like(like[:, :1])

    # ------------------------------------------------------------------ main entry

    def shard(self, s: int, a: Optional[Tensor], g: Tensor) -> Tensor:
        """``lam`` over ``[s, s + g.shape[1])``; shards must come right to left, contiguous."""
        L = g.shape[1]
        e = s + L
        if e != self._next:
            raise RuntimeError(f"truncated adjoint: shard [{s}, {e}) does not end where the previous one began ({self._next})")
        if a is not None:
            a = _expand_time(a, L)
        if self.kind == "dense":
            lam = self._shard_dense(s, a, g)
        else:
            lam = self._shard_diagonal(s, a, g)
        # new chunk list: this shard, then old chunks, covering at most W-1 steps
        self._chunks = [(s, a, g), *self._chunks]
        keep, covered = [], 0
        for c in self._chunks:
            if covered >= self.W - 1:
                break
            keep.append(c)
            covered += c[2].shape[1]
        self._chunks = keep
        self._next = s
        return lam

    # ------------------------------------------------------------------ diagonal

    def _block_masks(self, s: int, L: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``keep_i`` (1 unless step i ends a block or the sequence) and its complement."""
        idx = torch.arange(s, s + L, device=device)
        end = ((idx + 1) % self.W == 0) | (idx + 1 >= self.T)
        return (~end).to(dtype), end.to(dtype)

    def _shard_diagonal(self, s: int, a: Optional[Tensor], g: Tensor) -> Tensor:
        from gradshard.kernels import linear_scan

        L, e, W, T = g.shape[1], s + g.shape[1], self.W, self.T
        dtype = g.dtype
        ones_like_a = (lambda n: torch.ones((1, n, *([1] * (g.dim() - 2))), dtype=dtype, device=g.device))
        a_full = a if a is not None else ones_like_a(L)
        shape_tail = [1] * (g.dim() - 2)
        keep, end = self._block_masks(s, L, g.device, dtype)
        keep = keep.view(1, L, *shape_tail)
        end = end.view(1, L, *shape_tail)
        a_next = torch.cat([a_full[:, 1:], self._a_after(e, a_full).to(a_full.dtype) if a is not None else ones_like_a(1)], 1)
        coef = a_next * keep
        S = linear_scan(coef, g, self._carry_S, reverse=True)
        R = linear_scan(coef, torch.broadcast_to(end, coef.shape).contiguous(), self._carry_R, reverse=True)
        self._carry_S, self._carry_R = S[:, 0], R[:, 0]
        # F of the blocks starting inside this shard
        first = -(-s // W) * W
        F_all: Optional[Tensor] = None
        F_start = 0
        if first < e and first < T:
            last = ((e - 1) // W) * W
            stop = min(last + W, T)  # up to the next block start: contiguous with the cache
            if stop > first:
                aa, gg = self._range(first, stop, a, g, s)
                n = stop - first
                aa = aa if aa is not None else ones_like_a(n)
                pos = torch.arange(first, stop, device=g.device)
                start_mask = (pos % W == 0).to(dtype).view(1, n, *shape_tail)
                # P_k = a_k * (P_{k-1} unless k starts a block, else 1)
                P = linear_scan(aa * (1 - start_mask), torch.broadcast_to(aa * start_mask, aa.shape).contiguous(), None)
                F = linear_scan(torch.broadcast_to(1 - start_mask, (1, n, *shape_tail)), P * gg, None)
                F_all, F_start = F, first
                self._cache_new = (first, F[:, : min(W - 1, T - first)])
            else:
                self._cache_new = None
        else:
            self._cache_new = None
        lam = S + R * self._next_block_terms(s, L, F_all, F_start, g)
        if self._cache_new is not None:
            self._cache = self._cache_new
        return lam

    def _next_block_terms(self, s: int, L: int, F_local: Optional[Tensor], F_start: int, g: Tensor) -> Tensor:
        """``F^{nb(i)}_{min(i+W-1, T-1)}`` for every i of the shard (zero where it does not apply)."""
        W, T = self.W, self.T
        pieces, start = [], None
        if F_local is not None:
            pieces.append(F_local)
            start = F_start
        if self._cache is not None:
            c_start, c_F = self._cache
            if start is None:
                start = c_start
            if start + sum(p.shape[1] for p in pieces) == c_start:
                pieces.append(c_F)
        out = torch.zeros_like(g)
        if not pieces:
            return out
        F_all = torch.cat(pieces, 1) if len(pieces) > 1 else pieces[0]
        i = torch.arange(s, s + L, device=g.device)
        nb = (i // W + 1) * W
        k = torch.minimum(i + W - 1, torch.full_like(i, T - 1))
        valid = (i % W != 0) & (nb < T) & (k - start >= 0) & (k - start < F_all.shape[1])
        if not bool(valid.any()):
            return out
        idx = (k - start).clamp(0, F_all.shape[1] - 1)
        gathered = F_all.index_select(1, idx)
        mask = valid.to(g.dtype).view(1, L, *([1] * (g.dim() - 2)))
        return gathered * mask

    # ------------------------------------------------------------------ dense

    def _shard_dense(self, s: int, A: Tensor, g: Tensor) -> Tensor:
        L, e, W, T = g.shape[1], s + g.shape[1], self.W, self.T
        n = A.shape[-1]
        eye = torch.eye(n, dtype=g.dtype, device=g.device).expand(*A.shape[:1], *A.shape[2:])
        S = torch.empty_like(g)
        R = torch.empty(*A.shape[:1], L, *A.shape[2:], dtype=g.dtype, device=g.device)
        S_next, R_next = self._carry_S, self._carry_R
        A_after = self._chunks[0][1][:, 0] if self._chunks and e < T else None
        for t in range(L - 1, -1, -1):
            i = s + t
            is_end = (i + 1) % W == 0 or i + 1 >= T
            A_next = A[:, t + 1] if t + 1 < L else A_after
            if is_end or S_next is None or A_next is None:
                S[:, t], R[:, t] = g[:, t], eye
            else:
                At = A_next.transpose(-1, -2)
                S[:, t] = g[:, t] + At @ S_next
                R[:, t] = At @ R_next
            S_next, R_next = S[:, t], R[:, t]
        self._carry_S, self._carry_R = S[:, 0], R[:, 0]
        first = -(-s // W) * W
        F_all, F_start, new_cache = None, 0, None
        if first < e and first < T:
            last = ((e - 1) // W) * W
            stop = min(last + W, T)  # up to the next block start: contiguous with the cache
            if stop > first:
                aa, gg = self._range(first, stop, A, g, s)
                F = torch.empty_like(gg)
                P = F_prev = None
                for k in range(stop - first):
                    pos = first + k
                    At = aa[:, k].transpose(-1, -2)
                    if pos % W == 0 or P is None:
                        P, F_prev = At, torch.zeros_like(gg[:, k])
                    else:
                        P = P @ At
                    F_prev = F_prev + P @ gg[:, k]
                    F[:, k] = F_prev
                F_all, F_start = F, first
                new_cache = (first, F[:, : min(W - 1, T - first)])
        # R_i is a matrix: lam_i = S_i + R_i @ F
        Fn = self._dense_next_terms(s, L, F_all, F_start, g)
        lam = S + R @ Fn
        if new_cache is not None:
            self._cache = new_cache
        return lam

    def _dense_next_terms(self, s: int, L: int, F_local: Optional[Tensor], F_start: int, g: Tensor) -> Tensor:
        return self._next_block_terms(s, L, F_local, F_start, g)


def truncated_lambda(a: Optional[Tensor], g: Tensor, window: int, *, kind: str = "diagonal",
                     shard_size: Optional[int] = None) -> Tensor:
    """``lam`` for a whole sequence (time dim 1), streamed in shards of ``shard_size``."""
    T = g.shape[1]
    shard = shard_size or max(T, 1)
    sweep = TruncatedSweep(kind, window, T)
    out = torch.empty_like(g)
    for s in range(((T - 1) // shard) * shard if T else 0, -1, -shard):
        e = min(s + shard, T)
        a_s = None if a is None else (a if a.shape[1] == 1 else a[:, s:e])
        out[:, s:e] = sweep.shard(s, a_s, g[:, s:e])
    return out
