"""Truncated adjoint states in O(T), streamed over time shards in reverse.

``plan="truncated_adjoint"`` with window ``W`` (docs/DESIGN.md; paper eq. 7) uses, for 0-based
steps ``i < T``::

    lam_i = sum_{t=i}^{min(i+W-1, T-1)} (prod_{j=i+1}^{t} a_j) g_t       (dense: A_j^T, right to left)

Both forms here compute it as the *exact* adjoint of corrected direct gradients. With
``kappa_i = prod_{j=i+1}^{i+W} a_j`` (zero-extended past ``T``)::

    g'_i = g_i - kappa_i g_{i+W}        =>   sum_{t>=i} (prod_{j=i+1}^{t} a_j) g'_t = lam_i

(the sum telescopes: ``prod_{j=i+1}^{t} a_j kappa_t = prod_{j=i+1}^{t+W} a_j``). So a truncated
shard is an adjoint shard run on ``g'``, and every window product costs O(1) per step:

* :class:`StepTruncation` (per-step shards, diagonal or dense): ``kappa_i = R_i P_{i+W}`` with
  blocks ``[bW, (b+1)W)`` on the global grid, ``R_i = prod_{j=i+1}^{end(i)} a_j`` (reverse
  cumulative product inside ``i``'s block) and ``P_k = prod_{j=start(k)}^{k} a_j`` (forward
  inside ``k``'s block): ``(i, i+W]`` is the rest of ``i``'s block then the head of the next. No
  cumulative product is divided (``a`` may be tiny, zero or negative).
* :class:`ChunkedTruncation` (block-form shards): ``kappa`` from suffix sums of ``log|a|``,
  zeros and signs, per head.

Where decays stay near 1 over many windows, the carry between shards is a difference of sums
growing with ``T`` (up to ``min(T, 1 / (1 - a))`` terms instead of ``W``), with that rounding: in
float32 with ``a = 1`` at ``T = 10^6``, ``W = 10^3``, about ``6e-5`` of ``lam``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from gradshard.kernels.backend import accumulation_dtype

__all__ = ["ChunkedTruncation", "StepTruncation", "truncated_lambda"]


def _expand_time(x: Tensor, length: int) -> Tensor:
    return x.expand(x.shape[0], length, *x.shape[2:]) if x.shape[1] == 1 and length != 1 else x

#: up to this many elements a cumulative product runs as ``torch.cumprod``; above it
#: as a masked :func:`~gradshard.kernels.linear_scan`, whose chunked form is faster on CPU, where
#: torch's cumulative ops along a strided dim are not vectorised (measured, 2 threads: 1024 steps
#: x 2048 floats 7.4 ms vs 1.9 ms; at 128 x 1024 floats 0.13 ms vs 0.45 ms)
_TORCH_CUMULATIVE_MAX = 1 << 17


def _within_blocks(x: Tensor, pos: int, W: int, reverse: bool = False, carry: Optional[Tensor] = None) -> Tensor:
    """Cumulative product along time inside each block ``[bW, (b+1)W)`` of the global grid, ``x``
    covering steps ``[pos, pos + x.shape[1])``; ``reverse`` runs from each block's end. The segment
    at the start of ``x`` (``reverse``: its end) continues from ``carry`` (a step's value) when its
    block goes on past ``x``, else from 1."""
    n = x.shape[1]
    continued = carry is not None and ((pos + n) % W if reverse else pos % W) != 0
    if x.numel() > _TORCH_CUMULATIVE_MAX:
        from gradshard.kernels import linear_scan

        idx = torch.arange(pos, pos + n, device=x.device)
        restart = (idx + 1) % W == 0 if reverse else idx % W == 0
        if not continued:
            restart |= idx == (pos + n - 1 if reverse else pos)
        restart = restart.to(x.dtype).view(1, n, *([1] * (x.dim() - 2)))
        h0 = carry.to(x.dtype).expand(x.shape[0], *x.shape[2:]).contiguous() if continued else None
        return linear_scan(x * (1 - restart), x * restart, h0, reverse=reverse)
    acc = accumulation_dtype(x.dtype)  # as the scan: half inputs accumulate in float32

    def run(t: Tensor, dim: int) -> Tensor:
        return (torch.cumprod(t.flip(dim), dim, dtype=acc).flip(dim) if reverse
                else torch.cumprod(t, dim, dtype=acc)).to(x.dtype)

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
        seg.mul_(carry.unsqueeze(1))
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


class StepTruncation:
    """The corrected gradients ``g'_i = g_i - kappa_i g_{i+W}`` of per-step shards given right to left
    (see the module doc); the exact adjoint shard run on them gives the windowed ``lam``.

    ``kind``: ``"diagonal"`` (``a`` broadcasts to ``g``; ``None`` means 1) or ``"dense"``
    (``a``: ``(B, S, N, N)``, ``g``: ``(B, S, N, P)``). Kept between shards: ``(a, g)`` from the last
    shard's start to its block's end (the shard left of it runs ``P`` on through them), ``P g``
    over the first block starting in or after the last shard, and one step of ``a`` and ``R``:
    O(W + shard) memory, every ``R`` and ``P`` computed once.
    """

    def __init__(self, kind: str, window: int, length: int) -> None:
        if window < 1:
            raise ValueError(f"truncated adjoint: window must be >= 1, got {window}")
        if kind not in ("diagonal", "dense"):
            raise ValueError(f"truncated adjoint: unknown recurrence kind {kind!r}")
        self.kind, self.W, self.T = kind, int(window), int(length)
        self._next = self.T  # start of the last shard corrected
        self._chunks: list[tuple[int, Optional[Tensor], Tensor]] = []  # (start, a, g), increasing
        self._a_first: Optional[Tensor] = None  # a at the last shard's start (its left neighbour's a_{i+1})
        self._carry_R: Optional[Tensor] = None  # R at the last shard's start
        self._pg: list[tuple[int, Tensor]] = []  # P g over the first block starting at or after it

    def correct(self, s: int, a: Optional[Tensor], g: Tensor) -> Tensor:
        """``g'`` over shard ``[s, s + g.shape[1])``; shards must come right to left, contiguous.
        ``g`` itself is kept (not modified): later shards read ``g_{i+W}``, uncorrected."""
        L, W = g.shape[1], self.W
        e = s + L
        if e != self._next:
            raise RuntimeError(f"truncated adjoint: shard [{s}, {e}) does not end where the previous one began "
                               f"({self._next}); shards must come right to left")
        if a is not None:
            a = _expand_time(a, L)
        fresh = self._block_products(s, a, g)
        n = min(L, max(0, self.T - W - s))  # steps with i + W < T: the only ones corrected
        R = None
        if a is not None and (n or s % W):  # R_s: the left shard's R goes on from it inside s's block
            R = self._reverse_products(s, a, g)
        out = g
        if n:
            pg = _slice(fresh + self._pg, s + W, s + W + n, s)
            out = g.clone()
            if R is None:
                out[:, :n] -= pg
            elif self.kind == "dense":
                out[:, :n] -= R[:, :n] @ pg
            else:
                out[:, :n].addcmul_(R[:, :n], pg, value=-1)
        self._a_first = None if a is None else a[:, :1]
        self._carry_R = None if R is None else R[:, 0]
        stop = -(-s // W) * W if s > W else s  # the end of the block of step s - 1 (block 0: never read)
        self._chunks = [(c, ca, cg) if c + cg.shape[1] <= stop else
                        (c, None if ca is None else ca[:, :stop - c], cg[:, :stop - c])
                        for c, ca, cg in [(s, a, g), *self._chunks] if c < stop]
        if fresh:
            first = fresh[0][0]
            self._pg = [(p, x[:, :first + W - p]) for p, x in fresh if p < first + W]
        self._next = s
        return out

    def _a_after(self, e: int, like: Tensor) -> Tensor:
        """``a_e`` (first step after the shard); ones past the end."""
        if self._a_first is not None and e < self.T:
            return self._a_first.to(like.dtype)
        if self.kind == "dense":
            return torch.eye(like.shape[-1], dtype=like.dtype, device=like.device).expand_as(like[:, :1])
        return torch.ones_like(like[:, :1])

    def _reverse_products(self, s: int, a: Tensor, g: Tensor) -> Tensor:
        """``R_i = prod_{j=i+1}^{end(i)} a_j`` over the shard (the identity where ``i`` ends its block),
        continued from ``R`` at the shard after it when the block goes on past the shard."""
        L, W, e = a.shape[1], self.W, s + a.shape[1]
        x = torch.cat([a[:, 1:], self._a_after(e, a)], 1)  # x_i = a_{i+1}
        first_end = (W - 1 - s) % W  # the shard's first step that ends a block
        if self.kind == "diagonal":
            x[:, first_end::W] = 1
            return _within_blocks(x, s, W, reverse=True, carry=self._carry_R)
        eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
        R = torch.empty_like(x)
        R_next = self._carry_R if e % W and e < self.T else None
        for t in range(L - 1, -1, -1):
            ends = (t - first_end) % W == 0 or R_next is None
            R[:, t] = eye if ends else x[:, t].transpose(-1, -2) @ R_next
            R_next = R[:, t]
        return R

    def _block_products(self, s: int, a: Optional[Tensor], g: Tensor) -> list[tuple[int, Tensor]]:
        """``P_k g_k`` from each block start inside the shard (block 0's is never read) to the end of
        the last one's block, as ``(start, piece)``: the shard's part, then one piece per kept chunk,
        each continuing ``P`` from the piece before."""
        W, T, e = self.W, self.T, s + g.shape[1]
        first = max(-(-s // W) * W, W)
        if first >= min(e, T):
            return []
        stop = min(((e - 1) // W) * W + W, T)
        lo = first - s
        P, pieces = None, []
        for start, ca, cg in [(first, None if a is None else a[:, lo:], g[:, lo:]), *self._chunks]:
            if start >= stop:
                break
            n = min(stop, start + cg.shape[1]) - start
            if ca is None:
                pieces.append((start, cg[:, :n]))
                continue
            P = self._forward_products(ca[:, :n], start, None if P is None else P[:, -1])
            pieces.append((start, P * cg[:, :n] if self.kind == "diagonal" else P @ cg[:, :n]))
        return pieces

    def _forward_products(self, a: Tensor, pos: int, carry: Optional[Tensor]) -> Tensor:
        """``P`` over steps ``[pos, pos + n)``: cumulative products of ``a`` (dense: ``A^T`` multiplied
        on the right) restarting at block starts, the first segment continued from ``carry``."""
        if self.kind == "diagonal":
            return _within_blocks(a, pos, self.W, carry=carry)
        P = torch.empty_like(a)
        prev = carry
        for t in range(a.shape[1]):
            At = a[:, t].transpose(-1, -2)
            prev = At if (pos + t) % self.W == 0 or prev is None else prev @ At
            P[:, t] = prev
        return P


def truncated_lambda(a: Optional[Tensor], g: Tensor, window: int, *, kind: str = "diagonal",
                     shard_size: Optional[int] = None) -> Tensor:
    """``lam`` for a whole sequence (time dim 1), streamed in shards of ``shard_size``: each shard the
    exact adjoint sweep of its corrected gradients (a reference for the runtime's use)."""
    from gradshard.plans.adjoint.scan import recurrence_for

    rec = recurrence_for(kind)
    T = g.shape[1]
    shard = shard_size or max(T, 1)
    sweep = StepTruncation(kind, window, T)
    out = torch.empty_like(g)
    carry = None
    for s in range(((T - 1) // shard) * shard if T else 0, -1, -shard):
        e = min(s + shard, T)
        a_s = None if a is None else (a if a.shape[1] == 1 else a[:, s:e])
        corrected = sweep.correct(s, a_s, g[:, s:e])
        zeros = torch.zeros_like(corrected)
        _, out[:, s:e], carry = rec.adjoint_shard(a_s, zeros, corrected, None, carry, h=zeros)
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
