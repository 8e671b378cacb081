"""What one shard of an adjoint region runs, forward and backward.

* :func:`forward_shard`: producers, scan and readout of one shard as one function of its window
  and starting state -- traced and compiled whole when the program has a compiler
  (:meth:`AdjointRegion.run_shard <gradshard.plans.adjoint.runtime.AdjointRegion.run_shard>`);
* :func:`adjoint_shard_grads`: the per-step adjoint's backward shard (producers recomputed with
  grad, states from the checkpoint, ``dL/dh`` from the readout's VJP, the adjoint scan, one VJP
  through the producers); :func:`shard_vjp` is the same traced and compiled whole (the exact
  adjoint: the truncated one's correction is stateful and runs graph by graph);
* :func:`chunked_shard_grads`: a chunked region's shard graph again from its checkpoint with grad,
  one VJP with ``dL/dy`` and the carried ``dL/dh_end``.

A whole-shard function is one compiled call per shard instead of a compiled call per graph with
the scan kernel and autograd between them; Inductor also fuses across the graphs' boundaries
(the canonical layout's copies, the readout's VJP into the adjoint scan's input) and plans the
shard's buffers as one. Where its trace or compile fails it runs graph by graph
(:func:`forward_shard_graphs`, :func:`shard_vjp_graphs`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from gradshard.plans.adjoint.layout import canon, narrow, state_canon, state_uncanon, uncanon
from gradshard.plans.adjoint.respecialize import grad_leaves, wanted_grads
from gradshard.plans.adjoint.truncated import ChunkedTruncation, StepTruncation

#: an :class:`~gradshard.plans.adjoint.runtime.AdjointRegion` (not imported: that module imports this one)
AdjointRegion = Any

__all__ = ["readout_grads", "adjoint_shard_grads", "chunked_shard_grads", "forward_shard", "forward_shard_graphs",
           "shard_vjp", "shard_vjp_graphs", "compiled_shard_grads"]


def readout_grads(region: AdjointRegion, hc: Tensor, r_leaves: Sequence[Any], dys: Sequence[Optional[Tensor]],
                  start: int, final: Optional[Tensor], traced: bool = False) -> tuple[Tensor, list[Optional[Tensor]]]:
    """``dL/dh`` (canonical) for states ``hc`` of steps ``[start, start + len)`` from the readout's VJP
    with the incoming ``dys``, plus ``final`` (the final state's gradient) at the last step; and the
    gradients of the readout's producer values ``r_leaves`` (None where not needed)."""
    sp, io = region.scan, region.io
    h_leaf = region.h_for_readout(hc).detach().requires_grad_(True)
    with torch.enable_grad():
        ys = region.run_readout(h_leaf, r_leaves, traced=traced)
    n = int(hc.shape[1])
    pairs = [(y, narrow(dy, td, start, n)) for y, dy, td in zip(ys, dys, io.output_time_dims)
             if dy is not None and y.requires_grad]
    wanted = [i for i, r in enumerate(r_leaves) if isinstance(r, Tensor) and r.requires_grad]
    wrt = [h_leaf, *(r_leaves[i] for i in wanted)]
    got = (torch.autograd.grad([p[0] for p in pairs], wrt, [p[1] for p in pairs], allow_unused=True)
           if pairs else [None] * len(wrt))
    # dense in the scan's step order: a readout VJP may return it transposed (an einsum's layout),
    # which makes every step of the reverse scan a strided read (1.6x slower on Mamba-2's states)
    gc = canon(got[0] if got[0] is not None else torch.zeros_like(h_leaf), sp.time_dim, sp.rank).contiguous()
    if final is not None and n:
        gc = gc.clone()
        gc[:, -1] += state_canon(final, sp.rank).to(gc.dtype)
    d_r: list[Optional[Tensor]] = [None] * len(r_leaves)
    for i, g in zip(wanted, got[1:]):
        d_r[i] = g
    return gc, d_r


def adjoint_shard_grads(region: AdjointRegion, leaves: list[Any], needs: Sequence[bool], ckpt: Optional[Tensor],
                        dys: Sequence[Optional[Tensor]], s: int, e: int, ws: int, we: int, carry: Optional[Tensor],
                        d_final: Optional[Tensor], sweep: Optional[StepTruncation],
                        traced: bool = False) -> tuple[dict[int, Tensor], Optional[Tensor]]:
    """Shard ``[s, e)`` (window ``[ws, we)``, state checkpoint ``ckpt``; None: the first shard) by the
    per-step adjoint: the inputs' gradients from one VJP through the producers, and the carry
    ``dL/dh`` at the shard's start. ``carry`` is the later shard's; ``d_final`` the final state's
    gradient (last shard only); ``sweep`` the truncated adjoint's gradient correction, else None.
    ``traced``: the graphs themselves, not their compiled variants (inside :func:`shard_vjp`)."""
    sp = region.scan
    with torch.enable_grad():
        run = region.trimmed_producer if traced else region.producers_on
        outs = run(we - ws, s - ws, e - s)(*leaves)
        prod = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    a, u, h0, rs = region.split(prod)
    h_start = ckpt if ckpt is not None else state_canon(h0, sp.rank)
    h_start_d = None if h_start is None else h_start.detach()
    ac, uc = region.canon_au(a, u)
    acd = None if ac is None else ac.detach()
    ucd = uc.detach()
    r_leaves = [r.detach().requires_grad_(r.requires_grad) if isinstance(r, Tensor) and r.dtype.is_floating_point else r
                for r in rs]
    with torch.no_grad():
        hc = region.rec.scan(acd, ucd, h_start_d, region.kernel_backend)
    gc, d_r = readout_grads(region, hc, r_leaves, dys, s, d_final, traced=traced)
    if sweep is not None:  # the windowed lam is the exact adjoint of the corrected gradients
        gc = sweep.correct(s, acd, gc)
    da, du, dh_start = region.rec.adjoint_shard(acd, ucd, gc, h_start_d, carry, region.kernel_backend, h=hc)
    carry = dh_start
    del hc, gc  # the shard's states: not needed by the VJP below
    # one VJP through this shard's producers (parameters and window inputs)
    outs_v: list[Tensor] = []
    grads_v: list[Tensor] = []
    if a is not None and a.requires_grad and da is not None:
        outs_v.append(a)
        grads_v.append(uncanon(da, sp.time_dim, sp.rank, a.shape))
    if u.requires_grad:
        outs_v.append(u)
        grads_v.append(uncanon(du, sp.time_dim, sp.rank, u.shape))
    if ckpt is None and h0 is not None and h0.requires_grad:
        outs_v.append(h0)
        grads_v.append(state_uncanon(dh_start, sp.rank).reshape(h0.shape).to(h0.dtype))
    for r_orig, dr in zip(rs, d_r):
        if dr is not None and isinstance(r_orig, Tensor) and r_orig.requires_grad:
            outs_v.append(r_orig)
            grads_v.append(dr)
    targets = [(i, leaves[i]) for i in range(len(leaves))
               if needs[i] and isinstance(leaves[i], Tensor) and leaves[i].requires_grad]
    shard_grads: dict[int, Tensor] = {}
    if outs_v and targets:
        gi = torch.autograd.grad(outs_v, [t for _, t in targets], grads_v, allow_unused=True)
        shard_grads = {i: gv for (i, _), gv in zip(targets, gi) if gv is not None}
    return shard_grads, carry


def chunked_shard_grads(region: AdjointRegion, leaves: list[Any], needs: Sequence[bool], ckpt: Optional[Tensor],
                        dys: Sequence[Optional[Tensor]], s: int, e: int, ws: int, we: int,
                        d_end: Optional[Tensor], window: Optional[ChunkedTruncation] = None,
                        stack: Optional[Tensor] = None) -> tuple[dict[int, Tensor], Optional[Tensor]]:
    """Shard ``[s, e)`` run chunked (:mod:`gradshard.plans.adjoint.chunked`): its graph again from
    its checkpoint ``ckpt`` with grad, one VJP with ``dL/dy`` and ``d_end`` (``dL/dh`` at the shard's
    end: the later shard's carry or the final state's gradient); returns the inputs' gradients and
    ``dL/dh`` at the shard's start. ``window``: the truncated adjoint's correction (its shards have
    state checkpoints ``stack``, canonical: their shape gives the contraction output's)."""
    io = region.io
    h_in = None if ckpt is None else ckpt.detach().requires_grad_(True)
    extra: list[Tensor] = []
    mode = None
    if window is not None:
        mode = "correct" if window.corrects(s) else "keep"
        state = stack[0]
        dv = state.shape[2] if region.chunked.contracted == -1 else state.shape[3]
        probe = torch.zeros(state.shape[0], e - s, state.shape[1], dv, dtype=state.dtype, device=state.device,
                            requires_grad=True)
        extra.append(probe)
        if mode == "correct":
            extra.append(window.query_next(s, e))
    with torch.enable_grad():
        outs = region.shard_on(we - ws, s - ws, e - s, h_in is not None, mode)(
            *leaves, *([] if h_in is None else [h_in]), *extra)
    if window is not None:
        *outs, query, a, y2 = outs
    *ys, h_end = outs
    pairs = [(y, narrow(dy, td, s, e - s)) for y, dy, td in zip(ys, dys, io.output_time_dims)
             if dy is not None and y.requires_grad]
    if d_end is not None and h_end.requires_grad:
        pairs.append((h_end, state_canon(d_end, region.scan.rank).to(h_end.dtype)))
    if mode == "correct" and y2.requires_grad:
        pairs.append((y2, window.y2_cotangent(s, e, a).to(y2.dtype)))
    targets = [i for i, x in enumerate(leaves) if needs[i] and isinstance(x, Tensor) and x.requires_grad]
    wrt = [leaves[i] for i in targets] + ([h_in] if h_in is not None else []) + extra[:1]
    if not wrt:  # nothing asks for a gradient (the probe is always there when window is given)
        return {}, None
    got = (list(torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
           if pairs else [None] * len(wrt))
    if window is not None:  # the shards left of this one read its steps, gradient or not
        d_probe = got.pop()
        window.keep(s, query, a, torch.zeros_like(extra[0]) if d_probe is None else d_probe)
    if not pairs:
        return {}, None
    grads = {i: g for i, g in zip(targets, got) if g is not None}
    return grads, (got[-1] if h_in is not None else None)


# --------------------------------------------------------------------------- whole shards, compiled


def forward_shard(region: AdjointRegion, length: int, start: int, steps: int,
                  *args: Optional[Tensor]) -> tuple[Tensor, ...]:
    """A forward shard as one function of its window and starting state (``args[-1]``; None: the
    initial one): producers, scan (the ``linear_scan`` custom op), readout; the readout outputs,
    then the state after the shard. What :meth:`AdjointRegion.run_shard` traces and compiles whole."""
    *win, h = args
    ys, h_end = region.run_shard(list(win), length, start, steps, h, chunked=False, how="traced")
    return (*ys, h_end)


def forward_shard_graphs(region: AdjointRegion, length: int, start: int, steps: int, *args: Optional[Tensor],
                         ) -> tuple[Tensor, ...]:
    """:func:`forward_shard` graph by graph (each compiled on its own): where the whole function is not."""
    *win, h = args
    ys, h_end = region.run_shard(list(win), length, start, steps, h, chunked=False, how="graphs")
    return (*ys, h_end)


def _shard_vjp_as(traced: bool, region: AdjointRegion, needs: tuple[bool, ...], length: int, start: int, steps: int,
                  n_leaves: int, *args: Optional[Tensor]) -> tuple[Tensor, ...]:
    """A backward shard as one function: ``args`` = the window's leaves (detached), the state
    checkpoint, the later shard's carry, the final state's gradient (None where absent) and the
    outputs' gradients on the shard's rows. Returns the gradient of every leaf that needs one
    (None where none reaches it), then the carry ``dL/dh`` at the shard's start. ``traced``: on the
    graphs themselves (:func:`shard_vjp`), else on their compiled variants (:func:`shard_vjp_graphs`)."""
    leaves, (ckpt, carry, d_final), dys = list(args[:n_leaves]), args[n_leaves:n_leaves + 3], args[n_leaves + 3:]
    with torch.enable_grad():
        leaves = grad_leaves(leaves, needs)
        grads, carry = adjoint_shard_grads(region, leaves, needs, ckpt, list(dys), 0, steps, -start, length - start,
                                           carry, d_final, None, traced=traced)
    return (*(grads.get(i) for i in wanted_grads(leaves, needs)), carry)


def shard_vjp(*args: Any) -> tuple[Tensor, ...]:
    """The exact adjoint's backward shard, traced whole: the producers' and readout's forward and
    backward, the states and the adjoint scan in one graph (``torch.autograd.grad`` inside
    ``make_fx``, as AOTAutograd traces a joint graph). Arguments as :func:`_shard_vjp_as`'s."""
    return _shard_vjp_as(True, *args)


def shard_vjp_graphs(*args: Any) -> tuple[Tensor, ...]:
    """:func:`shard_vjp` graph by graph (each compiled on its own, autograd between them): where the
    whole function is not compiled (its trace or compile failed, or past the variant cap)."""
    return _shard_vjp_as(False, *args)


def compiled_shard_grads(region: AdjointRegion, leaves: list[Any], needs: Sequence[bool], ckpt: Optional[Tensor],
                         dys: Sequence[Optional[Tensor]], s: int, e: int, ws: int, we: int, carry: Optional[Tensor],
                         d_final: Optional[Tensor]) -> tuple[dict[int, Tensor], Optional[Tensor]]:
    """:func:`adjoint_shard_grads` (exact adjoint) run as one compiled function (:func:`shard_vjp`):
    one call per shard instead of a compiled call per graph and autograd between them."""
    dy_rows = [None if dy is None else narrow(dy, td, s, e - s) for dy, td in zip(dys, region.io.output_time_dims)]
    flags = tuple(bool(n) for n in needs)
    detached = [x.detach() if isinstance(x, Tensor) else x for x in leaves]
    *got, carry = region.graphs.calls(shard_vjp, region, flags, we - ws, s - ws, e - s, len(leaves),
                                      *detached, ckpt, carry, d_final, *dy_rows, fallback=shard_vjp_graphs)
    return {i: g for i, g in zip(wanted_grads(detached, flags), got) if g is not None}, carry
