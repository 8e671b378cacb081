"""Torch reference for the diagonal linear scan ``h_t = a_t * h_{t-1} + u_t`` (chunked, exact).

Algorithm (no cumulative product is ever divided and no log is taken, so ``a`` may contain
zeros and values of any sign):

1. split the time axis into ``n`` chunks of length ``C ~ sqrt(T/2)`` plus a ragged tail of
   ``T mod C`` steps (at the end for the forward scan, at the start for the reverse one). The
   chunks are *views* ``(batch, n, C, *state)`` of the inputs and of the output, so nothing is
   transposed or copied;
2. *local pass*: run the recurrence from zero inside all chunks at once (``C`` vectorised
   steps, each over ``(batch, n, *state)``) and take each chunk's product of ``a``;
3. *carry pass*: a short sequential scan over the ``n`` chunk summaries gives every chunk's
   incoming state;
4. *final pass*: rerun the recurrence inside all chunks from their incoming states, writing
   straight into the output; then the tail continues from the last chunk's state.

That is about ``2C + n + (T mod C) <= 3.9 sqrt(T)`` vectorised steps instead of ``T``, and each
step applies exactly the recurrence's own multiply-add, so the result equals the naive loop up
to rounding (float64: relative error ~1e-15).

When ``a`` is much smaller than ``u`` (broadcast over state dims, e.g. one decay per head over a
``head_dim x d_state`` state), step 4 is one vectorised op instead of ``C``: the local pass writes
into the output, and since the recurrence is linear, ``h_t = local_t + (a_{c0} ... a_t) h_{c0-1}``
inside a chunk starting at ``c0`` -- the running products ``cumprod(a)`` over each chunk are
``a``-sized, so cheap, and multiply (never divide). About ``C + n`` steps plus one pass.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .backend import accumulation_dtype
from .scan_cpu import scan_cpu


def choose_chunk(length: int) -> int:
    """Chunk length minimising the number of sequential steps ``2C + ceil(T/C)``."""
    return max(1, int(math.ceil(math.sqrt(length / 2.0))))


def _time_view(x: torch.Tensor, start: int, n: int, chunk: int) -> torch.Tensor:
    """``x[:, start:start + n*chunk]`` as (b, n, C, *s); a time-broadcast ``x`` stays broadcast."""
    if x.shape[1] == 1:
        return x.unsqueeze(1).expand(x.shape[0], n, chunk, *x.shape[2:])
    return x[:, start:start + n * chunk].reshape(x.shape[0], n, chunk, *x.shape[2:])


def _steps_of(x: torch.Tensor, dim: int, order: range) -> list[torch.Tensor]:
    """The slices of ``x`` along ``dim`` in ``order`` (one ``unbind``: no indexing op per step)."""
    views = x.unbind(dim)
    return [views[i] for i in order]


def _recur(a: list[torch.Tensor], u: list[torch.Tensor], h: torch.Tensor, outs: list[torch.Tensor]) -> torch.Tensor:
    """``outs[k] = a[k] * outs[k-1] + u[k]`` from ``h``, written in place (one op per step); the last state."""
    for ak, uk, ok in zip(a, u, outs):
        h = torch.addcmul(uk, ak, h, out=ok)
    return h


def _recur_cast(a: list[torch.Tensor], u: list[torch.Tensor], h: torch.Tensor, outs: list[torch.Tensor],
                acc: torch.dtype) -> torch.Tensor:
    """:func:`_recur` for outputs in another dtype than ``acc``: the state stays in ``acc``."""
    for ak, uk, ok in zip(a, u, outs):
        h = torch.addcmul(uk, ak, h)
        ok.copy_(h)
    return h


#: ``a`` counts as small (the fix-up form) when ``u`` has at least this many times its elements
_SMALL_A = 4


def _scan_chunks_fixup(av: torch.Tensor, ov: torch.Tensor, a_steps: list[torch.Tensor], u_steps: list[torch.Tensor],
                       h: torch.Tensor, reverse: bool) -> torch.Tensor:
    """Chunks ``(b, n, C, *s)`` scanned into ``ov`` from state ``h`` by the fix-up form (module doc):
    the local pass from zero straight into ``ov``, the carry pass over the chunk summaries, then
    ``ov += cumprod(a) * (state entering the chunk)`` in one op. Returns the state after the last chunk."""
    batch, n, chunk = ov.shape[:3]
    steps = range(chunk - 1, -1, -1) if reverse else range(chunk)
    zero = torch.zeros((batch, n, *ov.shape[3:]), dtype=ov.dtype, device=ov.device)
    last = _recur(a_steps, u_steps, zero, _steps_of(ov, 2, steps))  # each chunk's local final state
    carries = _carry_pass(av, last, h, reverse)
    starts = carries[:, 1:] if reverse else carries[:, :n]  # the state entering each chunk
    running = av.flip(2).cumprod(2).flip(2) if reverse else av.cumprod(2)
    ov.addcmul_(running, starts.unsqueeze(2))
    return carries[:, 0] if reverse else carries[:, n]


def _carry_pass(av: torch.Tensor, last: torch.Tensor, h: torch.Tensor, reverse: bool) -> torch.Tensor:
    """``carries[c]``: the state entering chunk ``c`` (forward) / leaving it (reverse), ``(b, n + 1,
    *s)``, from each chunk's local final state ``last`` (from zero), its product of ``a`` and ``h``."""
    n = last.shape[1]
    prods = torch.prod(av, dim=2)
    prods = prods.expand(prods.shape[0], n, *prods.shape[2:])
    carries = torch.empty((last.shape[0], n + 1, *last.shape[2:]), dtype=last.dtype, device=last.device)
    order = range(n - 1, -1, -1) if reverse else range(n)
    cv = carries.unbind(1)
    cv[n if reverse else 0].copy_(h)
    _recur(_steps_of(prods, 1, order), _steps_of(last, 1, order), cv[n if reverse else 0],
           [cv[c] for c in order] if reverse else [cv[c + 1] for c in order])
    return carries


def scan_torch(
    a: torch.Tensor,
    u: torch.Tensor,
    h0: Optional[torch.Tensor] = None,
    reverse: bool = False,
    chunk: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
    compiled: bool = True,
) -> torch.Tensor:
    """Exact scan. ``a`` broadcasts to ``u`` (same ndim), ``h0`` is (batch, *state).

    Forward: ``h_t = a_t h_{t-1} + u_t``; reverse: ``h_t = a_t h_{t+1} + u_t``. Accumulates in
    float32 for half inputs (float64 for float64) and returns ``h`` shaped like ``u`` in
    ``out_dtype`` (default: the accumulation dtype).

    On CPU tensors (``compiled``, no ``chunk`` forced) one compiled C++ loop
    (:mod:`gradshard.kernels.scan_cpu`) when it builds here; else the chunked torch ops (module
    doc), where every sequential step is one ``addcmul`` written in place (the per-step slices
    come from one ``unbind``), so the Python cost is about one dispatch per step.
    """
    acc = accumulation_dtype(torch.promote_types(a.dtype, u.dtype))
    out_dtype = acc if out_dtype is None else out_dtype
    if compiled and chunk is None:
        out = scan_cpu(a, u, h0, reverse, out_dtype, acc)
        if out is not None:
            return out
    batch, length, state = u.shape[0], u.shape[1], tuple(u.shape[2:])
    out = torch.empty(u.shape, dtype=out_dtype, device=u.device)
    h = torch.zeros((batch, *state), dtype=acc, device=u.device)
    if h0 is not None:
        h.copy_(h0)
    if length == 0:
        return out
    a = a if a.dtype == acc else a.to(acc)  # once, not per step
    u = u if u.dtype == acc else u.to(acc)
    chunk = choose_chunk(length) if chunk is None else max(1, min(int(chunk), length))
    n, tail = divmod(length, chunk)
    main = tail if reverse else 0  # first time index covered by the chunks
    recur = _recur if out_dtype == acc else (lambda a_, u_, h_, o_: _recur_cast(a_, u_, h_, o_, acc))
    if n > 0:
        av, uv = _time_view(a, main, n, chunk), _time_view(u, main, n, chunk)
        ov = out[:, main:main + n * chunk].view(batch, n, chunk, *state)  # a view: writes land in out
        steps = range(chunk - 1, -1, -1) if reverse else range(chunk)
        a_steps, u_steps = _steps_of(av, 2, steps), _steps_of(uv, 2, steps)
        fixup = n > 1 and out_dtype == acc and a.numel() * _SMALL_A <= u.numel()
        if fixup:
            h = _scan_chunks_fixup(av, ov, a_steps, u_steps, h, reverse)
        elif n == 1:
            starts = h.unsqueeze(1)
        else:
            # local pass: the recurrence from zero inside every chunk, ping-ponging two buffers
            first, second = torch.zeros((2, batch, n, *state), dtype=acc, device=u.device).unbind(0)
            local = _recur(a_steps, u_steps, first, ([second, first] * ((chunk + 1) // 2))[:chunk])
            carries = _carry_pass(av, local, h, reverse)
            starts = carries[:, 1:] if reverse else carries[:, :n]
        if not fixup:  # final pass: the recurrence inside every chunk from its incoming state, into out
            o_steps = _steps_of(ov, 2, steps)
            cur = recur(a_steps, u_steps, starts, o_steps)
            h = cur[:, 0] if reverse else cur[:, -1]
    if tail:
        t0 = 0 if reverse else n * chunk
        order = range(tail - 1, -1, -1) if reverse else range(tail)
        a_t = a if a.shape[1] == 1 else a[:, t0:t0 + tail]
        a_tail = [a_t[:, 0]] * tail if a.shape[1] == 1 else _steps_of(a_t, 1, order)
        recur(a_tail, _steps_of(u[:, t0:t0 + tail], 1, order), h, _steps_of(out[:, t0:t0 + tail], 1, order))
    return out


def scan_naive(a: torch.Tensor, u: torch.Tensor, h0: Optional[torch.Tensor] = None, reverse: bool = False) -> torch.Tensor:
    """Per-timestep loop (the definition), in the accumulation dtype; for tests and tiny inputs."""
    acc = accumulation_dtype(torch.promote_types(a.dtype, u.dtype))
    a = a.expand(a.shape[0], u.shape[1], *a.shape[2:])
    h = torch.zeros((u.shape[0], *u.shape[2:]), dtype=acc, device=u.device) if h0 is None else h0.to(acc)
    out = torch.empty(u.shape, dtype=acc, device=u.device)
    steps = range(u.shape[1] - 1, -1, -1) if reverse else range(u.shape[1])
    for t in steps:
        h = a[:, t].to(acc) * h + u[:, t].to(acc)
        out[:, t] = h
    return out
