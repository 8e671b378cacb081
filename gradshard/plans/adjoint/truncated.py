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

from gradshard.kernels.backend import accumulation_dtype

__all__ = ["TruncatedSweep", "truncated_lambda"]


def _expand_time(x: Tensor, length: int) -> Tensor:
    return x.expand(x.shape[0], length, *x.shape[2:]) if x.shape[1] == 1 and length != 1 else x


#: up to this many elements a cumulative op runs as ``torch.cumprod`` / ``torch.cumsum``; above it
#: as a masked :func:`~gradshard.kernels.linear_scan`, whose chunked form is faster on CPU, where
#: torch's cumulative ops along a strided dim are not vectorised (measured, 2 threads: 1024 steps
#: x 2048 floats 7.4 ms vs 1.9 ms; at 128 x 1024 floats 0.13 ms vs 0.45 ms)
_TORCH_CUMULATIVE_MAX = 1 << 17


def _within_blocks(x: Tensor, pos: int, W: int, kind: str, reverse: bool = False,
                   carry: Optional[Tensor] = None) -> Tensor:
    """Cumulative product (``kind="prod"``) or sum (``"sum"``) along time inside each block
    ``[bW, (b+1)W)`` of the global grid, ``x`` covering steps ``[pos, pos + x.shape[1])``;
    ``reverse`` runs from each block's end. The segment at the start of ``x`` (``reverse``: its
    end) continues from ``carry`` (a step's value) when its block goes on past ``x``, else from
    the identity (as without ``carry``)."""
    n = x.shape[1]
    edge = pos + n - 1 if reverse else pos
    continued = carry is not None and ((pos + n) % W if reverse else pos % W) != 0
    if x.numel() > _TORCH_CUMULATIVE_MAX:
        from gradshard.kernels import linear_scan

        idx = torch.arange(pos, pos + n, device=x.device)
        restart = (idx + 1) % W == 0 if reverse else idx % W == 0
        if not continued:
            restart |= idx == edge
        restart = restart.to(x.dtype).view(1, n, *([1] * (x.dim() - 2)))
        h0 = carry.to(x.dtype).expand(x.shape[0], *x.shape[2:]).contiguous() if continued else None
        if kind == "sum":
            return linear_scan(1 - restart, x, h0, reverse=reverse)
        return linear_scan(x * (1 - restart), x * restart, h0, reverse=reverse)
    op = torch.cumprod if kind == "prod" else torch.cumsum
    acc = accumulation_dtype(x.dtype)  # as the scan: half inputs accumulate in float32

    def run(t: Tensor, dim: int) -> Tensor:
        return (op(t.flip(dim), dim, dtype=acc).flip(dim) if reverse else op(t, dim, dtype=acc)).to(x.dtype)

    head = min(n, (-pos) % W)
    body = (n - head) // W * W
    parts = [run(x[:, :head], 1)] if head else []
    if body:
        xb = x[:, head:head + body]
        parts.append(run(xb.reshape(xb.shape[0], body // W, W, *xb.shape[2:]), 2).reshape(xb.shape))
    if head + body < n:
        parts.append(run(x[:, head + body:], 1))
    out = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
    if continued:  # the open segment: ``(pos + n) % W`` steps at the end, ``head`` at the start
        seg = out[:, n - min((pos + n) % W, n):] if reverse else out[:, :head]
        (seg.mul_ if kind == "prod" else seg.add_)(carry.unsqueeze(1))
    return out


def _covers(pieces: list[tuple[int, Tensor]], lo: int, hi: int) -> bool:
    """Whether ``(start, tensor)`` pieces cover steps ``[lo, hi)``."""
    spans = sorted((max(lo, p), min(hi, p + t.shape[1])) for p, t in pieces)
    at = lo
    for a, b in spans:
        if a > at:
            break
        at = max(at, b)
    return at >= hi


def _slice(pieces: list[tuple[int, Tensor]], lo: int, hi: int, where: int) -> Tensor:
    """Steps ``[lo, hi)`` of ``(start, tensor)`` pieces, a view when one piece holds them."""
    if not _covers(pieces, lo, hi):
        raise RuntimeError(f"truncated adjoint: steps [{lo}, {hi}) of the next window are missing at the shard "
                           f"at {where}; shards must come right to left (chunked ones at most the window long)")
    parts, at = [], lo
    for p, t in sorted(pieces, key=lambda q: q[0]):
        if p <= at < p + t.shape[1] and at < hi:
            b = min(hi, p + t.shape[1])
            parts.append(t[:, at - p:b - p])
            at = b
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


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
        self._a_first: Optional[Tensor] = None  # a at the start of the last shard
        self._carry_S: Optional[Tensor] = None
        self._carry_R: Optional[Tensor] = None
        self._cache: list[tuple[int, Tensor]] = []  # F over the next block, as (start, piece)

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
        if self._a_first is not None and e < self.T:
            return self._a_first
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
        # what a later (left) shard reads from this one and the chunks: a_s, and the (a, g) from s
        # to the next block start, which it sums from its last block start (none in block 0)
        self._a_first = None if a is None else a[:, :1]
        stop = -(-s // self.W) * self.W if s > self.W else s
        self._chunks = [(c, ca, cg) if c + cg.shape[1] <= stop else
                        (c, None if ca is None else ca[:, :stop - c], cg[:, :stop - c])
                        for c, ca, cg in [(s, a, g), *self._chunks] if c < stop]
        self._next = s
        return lam

    # ------------------------------------------------------------------ diagonal

    def _shard_diagonal(self, s: int, a: Optional[Tensor], g: Tensor) -> Tensor:
        """``lam = S + R * F`` over the shard: one reverse scan (``S``), ``R`` as a cumulative
        product the size of ``a``, ``F`` sliced from the next blocks' sums."""
        from gradshard.kernels import linear_scan

        L, e, W, T = g.shape[1], s + g.shape[1], self.W, self.T
        # steps ending a block (or the sequence), relative to s: there S and R restart
        ends = [p - s for p in range(s + (W - 1 - s % W), e, W)] + ([T - 1 - s] if s < T <= e and T % W else [])
        if a is None:  # a = 1: S sums g inside each block, R = 1
            coef = torch.ones((1, L, *([1] * (g.dim() - 2))), dtype=g.dtype, device=g.device)
        else:
            coef = torch.cat([a[:, 1:], self._a_after(e, a).to(a.dtype)], 1)
        coef[:, ends] = 0
        S = linear_scan(coef, g, self._carry_S, reverse=True)
        self._carry_S = S[:, 0].clone()  # S becomes lam in place below
        sums = self._block_sums(s, a, g)
        terms = self._next_block_terms(s, L, sums + self._cache, g)
        if terms is None:  # no step of the shard reaches a next block (nor any left of it in its block)
            self._carry_R = None
        else:
            F, valid = terms
            R = valid
            if a is not None:  # R_i = prod_{j=i}^{E(i)} x_j with x_i = a_{i+1}, and 1 where step i ends its block
                x = coef.clone()
                x[:, ends] = 1
                R = _within_blocks(x, s, W, "prod", reverse=True, carry=self._carry_R)
                self._carry_R = R[:, 0]
                R = R if valid is None else R * valid
            S = S.add_(F) if R is None else S.addcmul_(R, F)
        if sums:  # the first block starting in the shard: its sums, for the shards left of it
            stop = min(sums[0][0] + W, T)
            self._cache = [(p, F_[:, : stop - p]) for p, F_ in sums if p < stop]
        return S

    def _block_sums(self, s: int, a: Optional[Tensor], g: Tensor) -> list[tuple[int, Tensor]]:
        """``F`` from each block start inside the shard (block 0's is never asked for) to the end of
        the last one's block, as ``(start, F)`` pieces: the shard's part, then one piece per kept
        chunk, continued from the piece before (no concatenation)."""
        W, T, e = self.W, self.T, s + g.shape[1]
        first = max(-(-s // W) * W, W)
        if first >= min(e, T):
            return []
        stop = min(((e - 1) // W) * W + W, T)
        lo = first - s
        P = None if a is None else _within_blocks(a[:, lo:], first, W, "prod")
        F = _within_blocks(g[:, lo:] if P is None else P * g[:, lo:], first, W, "sum")
        pieces, pos = [(first, F)], e
        for c_start, ca, cg in self._chunks:  # contiguous from e, increasing
            if pos >= stop:
                break
            n = min(stop, c_start + cg.shape[1]) - c_start
            P = None if ca is None else _within_blocks(ca[:, :n], c_start, W, "prod", carry=P[:, -1])
            F = _within_blocks(cg[:, :n] if P is None else P * cg[:, :n], c_start, W, "sum", carry=F[:, -1])
            pieces.append((c_start, F))
            pos = c_start + n
        return pieces

    def _next_block_terms(self, s: int, L: int, sources: list[tuple[int, Tensor]], g: Tensor,
                          ) -> Optional[tuple[Tensor, Optional[Tensor]]]:
        """``(F, valid)``: ``F^{nb(i)}_{min(i+W-1, T-1)}`` for every i of the shard, with ``valid``
        ``(1, L, 1, ...)`` zero where the term does not apply (None: it applies everywhere), or None
        when it applies nowhere. ``F`` is sliced from ``sources`` (``(start, F)`` pieces) when the
        steps asked for are one run ``[s+W-1, s+L+W-1)``, else gathered."""
        W, T, e = self.W, self.T, s + L
        v1 = min(e, ((T - 1) // W) * W)  # steps of the last block have no next block
        starts = range(-(-s // W) * W, v1, W)  # a block start sums nothing from the next block
        if W == 1 or s + (s % W == 0) >= v1:
            return None
        valid = None
        if len(starts) or v1 < e:
            valid = torch.ones((1, L, *([1] * (g.dim() - 2))), dtype=g.dtype, device=g.device)
            valid[:, [p - s for p in starts]] = 0
            valid[:, v1 - s:] = 0
        lo, hi = s + W - 1, e + W - 1
        if hi > T or not _covers(sources, lo, hi):
            lo = min(s + (s % W == 0) + W - 1, T - 1)
            hi = min(v1 - 1 - ((v1 - 1) % W == 0) + W - 1, T - 1) + 1
        F = _slice(sources, lo, hi, s)
        if hi - lo != L:
            i = torch.arange(s, e, device=g.device)
            F = F.index_select(1, (torch.clamp(i + W - 1, max=T - 1) - lo).clamp(0, hi - lo - 1))
        return F, valid

    # ------------------------------------------------------------------ dense

    def _shard_dense(self, s: int, A: Tensor, g: Tensor) -> Tensor:
        L, e, W, T = g.shape[1], s + g.shape[1], self.W, self.T
        n = A.shape[-1]
        eye = torch.eye(n, dtype=g.dtype, device=g.device).expand(*A.shape[:1], *A.shape[2:])
        S = torch.empty_like(g)
        R = torch.empty(*A.shape[:1], L, *A.shape[2:], dtype=g.dtype, device=g.device)
        S_next, R_next = self._carry_S, self._carry_R
        A_after = self._a_first[:, 0] if self._a_first is not None and e < T else None
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
        first = max(-(-s // W) * W, W)  # block 0's sums are never asked for
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
                new_cache = (first, F[:, : min(W, T - first)])
        # R_i is a matrix: lam_i = S_i + R_i @ F
        terms = self._next_block_terms(s, L, ([] if F_all is None else [(F_start, F_all)]) + self._cache, g)
        lam = S if terms is None else S + R @ (terms[0] if terms[1] is None else terms[0] * terms[1])
        if new_cache is not None:
            self._cache = [new_cache]
        return lam


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


class ChunkedTruncation:
    """The truncated adjoint of a chunked region (:mod:`gradshard.plans.adjoint.chunked`), whose
    shards are block-form graphs differentiated by autograd, never per-step states.

    With ``g_t`` the gradient reaching ``h_t`` from the readout and ``kappa_i = prod_{j=i+1}^{i+W} a_j``,
    the windowed ``lam_i`` is the exact adjoint of the direct gradients ``g_i - kappa_i g_{i+W}``::

        sum_{t>=i} (prod_{j=i+1}^{t} a_j) (g_t - kappa_t g_{t+W})
            = sum_{t>=i} (prod a) g_t - sum_{t>=i+W} (prod a) g_t = lam_i

    (``prod_{j=i+1}^{t} a_j kappa_t = prod_{j=i+1}^{t+W} a_j``). The readout is a contraction
    ``y_t = h_t q_t``, so ``g_t = outer(dy_t, q_t)``, and the correction is a second readout of the
    same states, ``y2_i = h_i q_{i+W}`` with cotangent ``-kappa_i dy_{i+W}``: the shard's one VJP
    (``chunked_shard_graph(truncated="correct")``) gives every input's windowed gradient, ``a``'s
    as ``lam_i h_{i-1}`` with the exact states. ``dy`` (the contraction output's gradient, read off
    a zero ``probe``), ``q`` and ``a`` of the ``W`` steps after a shard come from the shards right of
    it: shards must be at most ``W`` long and come right to left. Per step that keeps ``W`` query
    and value vectors and three scalars per head, never a state.

    ``kappa`` is a window's product, in O(shard) per shard whatever ``W``: suffix sums over time of
    ``log|a|``, of zeros and of negative signs (float64, per batch and head) give any window's
    magnitude, whether it holds a zero and its sign, without dividing products.

    The carry ``dL/dh`` between shards is the exact adjoint's of the corrected gradients: where
    the decays are near 1 over many windows it is a difference of sums growing with ``T``, with
    that rounding (as the exact adjoint's own sums).
    """

    def __init__(self, window: int, length: int) -> None:
        if window < 1:
            raise ValueError(f"truncated adjoint: window must be >= 1, got {window}")
        self.W, self.T = int(window), int(length)
        self._next = self.T
        #: (start, q, dy, suffix): suffix (b, n, H, 3) float64: sums over steps t..T-1 of log|a|, [a == 0], [a < 0]
        self._kept: list[tuple[int, Tensor, Tensor, Optional[Tensor]]] = []
        self._pending: Optional[tuple[int, Tensor]] = None  # the last shard's suffix sums

    def corrects(self, s: int) -> bool:
        """Whether shard ``[s, ...)`` has steps whose window ends before ``T`` (else: the exact VJP)."""
        return s + self.W < self.T

    def _gather(self, which: int, lo: int, hi: int) -> Tensor:
        """Steps ``[lo, hi)`` of kept field ``which`` (1: q, 2: dy, 3: suffix), zero past ``T``."""
        like = self._kept[0][which]
        zeros = like.new_zeros((like.shape[0], max(0, hi - max(lo, self.T)), *like.shape[2:]))
        if lo >= self.T:
            return zeros
        got = _slice([(start, fields[which - 1]) for start, *fields in self._kept], lo, min(hi, self.T), lo)
        return torch.cat([got, zeros], 1) if zeros.shape[1] else got

    def _suffix(self, s: int, a: Tensor) -> Tensor:
        """The suffix sums (see the class doc) at the shard's steps and, as one more row, at the step
        after it (zero at ``T``), which they continue from."""
        a = a.to(torch.float64)
        stats = torch.stack([torch.where(a == 0, 0.0, a.abs().log()), (a == 0).double(), (a < 0).double()], -1)
        e = s + a.shape[1]
        after = self._gather(3, e, e + 1) if e < self.T else stats.new_zeros(stats[:, :1].shape)
        return torch.cat([stats.flip(1).cumsum(1).flip(1) + after, after], 1)

    @staticmethod
    def _product(sums: Tensor) -> Tensor:
        """A window's product from its sums ``(log|a|, zeros, negatives)`` (last dim)."""
        sign = 1 - 2 * torch.remainder(sums[..., 2].round(), 2)
        return torch.where(sums[..., 1].round() > 0, 0.0, sign * sums[..., 0].exp())

    def query_next(self, s: int, e: int) -> Tensor:
        """``q`` at steps ``[s + W, e + W)`` (zero past ``T``)."""
        return self._gather(1, s + self.W, e + self.W)

    def y2_cotangent(self, s: int, e: int, a: Optional[Tensor]) -> Tensor:
        """``-kappa_i dy_{i+W}`` for ``i`` in ``[s, e)``; ``a`` the shard's decays per head (None: 1)."""
        W = self.W
        dy = self._gather(2, s + W, e + W)
        if a is None:
            return -dy
        sums = self._suffix(s, a)  # row k: the sums from step s + k on
        self._pending = (s, sums)  # for keep()
        kappa = self._product(sums[:, 1:] - self._gather(3, s + W + 1, e + W + 1))
        return -(kappa[..., None] * dy.double()).to(dy.dtype)

    def final_correction(self, d_final: Tensor) -> Tensor:
        """``-kappa_{T-1-W} dL/dh_{T-1}``: the final state's gradient (canonical, (b, H, d1, d2)) is a
        full-state direct gradient at the last step, so its correction enters as ``dL/dh`` at step
        ``T-1-W``, the end of a shard (:meth:`~gradshard.plans.adjoint.runtime.AdjointRegion.shards`)."""
        if self._kept[0][3] is None:  # no decay
            return -d_final
        kappa = self._product(self._gather(3, self.T - self.W, self.T - self.W + 1)[:, 0])
        return -(kappa[..., None, None] * d_final.double()).to(d_final.dtype)

    def keep(self, s: int, q: Tensor, a: Optional[Tensor], dy: Tensor) -> None:
        """Record shard ``[s, s + L)``'s queries, contraction gradients and decay sums for the shards
        left of it, dropping steps no later shard reads (from ``s + W + 1`` on)."""
        L = q.shape[1]
        if s + L != self._next or L > self.W:
            raise RuntimeError(f"truncated adjoint: chunked shard [{s}, {s + L}) must end where the previous one "
                               f"began ({self._next}) and be at most the window ({self.W}) long")
        pending, self._pending = self._pending, None
        suffix = None if a is None else (pending[1] if pending is not None and pending[0] == s else self._suffix(s, a))[:, :-1]
        stop = s + self.W + 1
        self._kept = [(p, q_[:, :stop - p], d_[:, :stop - p], None if x is None else x[:, :stop - p])
                      for p, q_, d_, x in [(s, q, dy, suffix), *self._kept] if p < stop]
        self._next = s
