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
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .backend import accumulation_dtype


def choose_chunk(length: int) -> int:
    """Chunk length minimising the number of sequential steps ``2C + ceil(T/C)``."""
    return max(1, int(math.ceil(math.sqrt(length / 2.0))))


def _time_view(x: torch.Tensor, start: int, n: int, chunk: int) -> torch.Tensor:
    """``x[:, start:start + n*chunk]`` as (b, n, C, *s); a time-broadcast ``x`` stays broadcast."""
    if x.shape[1] == 1:
        return x.unsqueeze(1).expand(x.shape[0], n, chunk, *x.shape[2:])
    return x[:, start:start + n * chunk].reshape(x.shape[0], n, chunk, *x.shape[2:])


def _step(a: torch.Tensor, u: torch.Tensor, h: torch.Tensor, acc: torch.dtype, out: Optional[torch.Tensor]) -> torch.Tensor:
    """One recurrence step ``a * h + u`` in ``acc``; written into ``out`` when given."""
    if a.dtype != acc:
        a = a.to(acc)
    if u.dtype != acc:
        u = u.to(acc)
    if out is None:
        return torch.addcmul(u, a, h)
    if out.dtype == acc:
        torch.addcmul(u, a, h, out=out)
        return out
    h = torch.addcmul(u, a, h)
    out.copy_(h)
    return h


def _at_chunk_pos(x: torch.Tensor, i: int) -> torch.Tensor:
    """Position ``i`` of every chunk: (b, n, C, *s) -> (b, n, *s)."""
    return x[:, :, i]


def scan_torch(
    a: torch.Tensor,
    u: torch.Tensor,
    h0: Optional[torch.Tensor] = None,
    reverse: bool = False,
    chunk: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Chunked exact scan. ``a`` broadcasts to ``u`` (same ndim), ``h0`` is (batch, *state).

    Forward: ``h_t = a_t h_{t-1} + u_t``; reverse: ``h_t = a_t h_{t+1} + u_t``. Accumulates in
    float32 for half inputs (float64 for float64) and returns ``h`` shaped like ``u`` in
    ``out_dtype`` (default: the accumulation dtype).
    """
    acc = accumulation_dtype(torch.promote_types(a.dtype, u.dtype))
    out_dtype = acc if out_dtype is None else out_dtype
    batch, length, state = u.shape[0], u.shape[1], tuple(u.shape[2:])
    out = torch.empty(u.shape, dtype=out_dtype, device=u.device)
    h = torch.zeros((batch, *state), dtype=acc, device=u.device)
    if h0 is not None:
        h.copy_(h0)
    if length == 0:
        return out
    chunk = choose_chunk(length) if chunk is None else max(1, min(int(chunk), length))
    n, tail = divmod(length, chunk)
    main = tail if reverse else 0  # first time index covered by the chunks
    at = lambda x, t: x[:, 0] if x.shape[1] == 1 else x[:, t]  # noqa: E731
    if n > 0:
        av, uv = _time_view(a, main, n, chunk), _time_view(u, main, n, chunk)
        ov = out[:, main:main + n * chunk].view(batch, n, chunk, *state)  # a view: writes land in out
        steps = range(chunk - 1, -1, -1) if reverse else range(chunk)
        if n == 1:
            starts = h.unsqueeze(1)
        else:
            # Ping-pong between two buffers: no allocation per step (large CPU allocations page-fault).
            bufs = torch.zeros((2, batch, n, *state), dtype=acc, device=u.device)
            local = bufs[0]
            for k, i in enumerate(steps):
                local = _step(_at_chunk_pos(av, i), _at_chunk_pos(uv, i), local, acc, bufs[(k + 1) % 2])
            prods = torch.prod(av.to(acc) if av.dtype != acc else av, dim=2)
            prods = prods.expand(prods.shape[0], n, *prods.shape[2:])
            starts = torch.empty((batch, n, *state), dtype=acc, device=u.device)
            for c in (range(n - 1, -1, -1) if reverse else range(n)):
                starts[:, c] = h
                h = torch.addcmul(local[:, c], prods[:, c], h)
        cur = starts
        for i in steps:
            cur = _step(_at_chunk_pos(av, i), _at_chunk_pos(uv, i), cur, acc, _at_chunk_pos(ov, i))
        h = cur[:, 0] if reverse else cur[:, -1]
    tail_steps = range(tail - 1, -1, -1) if reverse else range(n * chunk, length)
    for t in tail_steps:
        h = _step(at(a, t), at(u, t), h, acc, out[:, t])
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
