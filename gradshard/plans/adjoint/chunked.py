"""Chunked shards: a region whose state is an outer product read by a contraction runs each
shard as block-wise linear attention, never forming a per-step state.

Mamba-2's SSD layer (and every SSD hybrid), written as gradshard's canonical scan, is::

    h_t = a_t h_{t-1} + x_t B_t^T        a_t a scalar per head, h_t (head_dim, d_state)
    y_t = h_t C_t                        einsum("blhpn,blhn->blhp", h, C)

Run step by step, every step materialises a ``head_dim x d_state`` state per head, three
times per shard (forward, backward recompute, adjoint scan): memory-bound, and 18-40x slower
on CPU than a block form at ``head_dim = d_state = 64``. The recurrence is causal linear
attention with per-step decay (``q = C, k = B, v = x``, state ``S = h^T``), computed block by
block with matmuls from an initial state, returning the final one. The shard becomes one
graph::

    (window inputs, h_start) -> producers, trimmed -> block form -> readout -> (y..., h_end)

with the block form

* SSD's own (:func:`gradshard.kernels.ssd_torch.ssd_chunk_scan`) when ``a = exp(z)``: plain
  ops from the log-decay, which autograd differentiates and Inductor fuses (3x faster than
  the per-step scan at Mamba-2's tiny test sizes on CPU, compiled);
* else ``gradshard::lightning_attention`` on the decay itself (division- and log-free, its VJP
  registered; Triton kernels on GPU).

Forward: shard by shard without grad, keeping ``h_end`` as the next shard's checkpoint (as
the per-step form). Backward, right to left: the shard graph again with grad from its
checkpoint, and one VJP with the incoming ``dL/dy`` and the carried ``dL/dh_end``; the
initial state's gradient is the carry for the shard before. Exact; the backward holds one
shard's block tensors, never its per-step states. The truncated adjoint windows the per-step
adjoint state, so its regions keep the per-step form.

:func:`match_chunked_form` recognises the form on the region's captured graphs by structure
and shape (a product of ``x[..., None]`` and ``B[..., None, :]`` as ``u``; ``a`` broadcast over
the state; the state read only by that contraction), not by model; :func:`chunked_shard_graph`
builds the shard graph at a window length.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

import gradshard.ops.lightning  # noqa: F401 - registers torch.ops.gradshard.lightning_attention
from gradshard.kernels.ssd_torch import ssd_chunk_scan
from gradshard.plans.adjoint.layout import RegionIO, ScanSpec, trim

__all__ = ["ChunkedForm", "match_chunked_form", "chunked_shard_graph", "chunk_for"]

aten = torch.ops.aten


@dataclass(frozen=True)
class ChunkedForm:
    """A region runs its shards chunked (:mod:`gradshard.plans.adjoint.chunked`)."""

    chunk: int  # block length
    head_dim: int
    d_state: int
    x_arg: int  # which argument of the product ``u = x[..., None] * B[..., None, :]`` is ``x``
    #: ``a = exp(z)`` with ``z`` (batch, time, heads): the shard computes SSD's block form from ``z``
    #: (:func:`gradshard.kernels.ssd_torch.ssd_chunk_scan`, plain ops a compiler fuses); else the
    #: ``gradshard::lightning_attention`` op on the decay itself
    log_decay: bool = False

    def describe(self) -> str:
        how = "SSD block form from the log-decay" if self.log_decay else "gradshard::lightning_attention"
        return (f"shards run chunked ({how}, blocks of {self.chunk}; the {self.head_dim}x{self.d_state} "
                "state per head is never formed per step)")


def chunk_for(head_dim: int, d_state: int) -> int:
    """The block length: about ``sqrt(head_dim * d_state)`` (the block's ``C^2`` score work against
    its ``dk * dv`` state work), a power of two in [16, 64]."""
    return int(min(64, max(16, 2 ** round(math.log2(math.sqrt(max(1, head_dim * d_state)))))))


def _shape(n: Any) -> Optional[tuple[int, ...]]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _outputs(gm: fx.GraphModule) -> tuple[fx.Node, list[Any]]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = out.args[0]
    return out, (list(vals) if isinstance(vals, (tuple, list)) else [vals])


def _outer_factors(u: Any) -> Optional[tuple[fx.Node, fx.Node]]:
    """``(x_e, B_e)`` when ``u = x_e * B_e`` with ``x_e`` (..., P, 1) and ``B_e`` (..., 1, N), both
    of ``u``'s full shape but the broadcast dim (in either order)."""
    if not isinstance(u, fx.Node) or u.op != "call_function" or u.target is not aten.mul.Tensor:
        return None
    l, r = u.args[:2]
    us = _shape(u)
    if us is None or len(us) != 5:
        return None
    for xe, be in ((l, r), (r, l)):
        xs, bs = _shape(xe), _shape(be)
        if xs == us[:-1] + (1,) and bs == us[:-2] + (1, us[-1]):
            return xe, be
    return None  # (shapes are read at the captured length; re-specialised graphs use ChunkedForm.x_arg)


_VIEWS = (aten.unsqueeze.default, aten.view.default, aten.reshape.default)


def _log_decay(a: Any) -> Optional[fx.Node]:
    """``z`` when ``a`` is ``exp(z)`` seen through trailing unsqueezes/views."""
    while isinstance(a, fx.Node) and a.op == "call_function" and a.target in _VIEWS:
        a = a.args[0]
    if isinstance(a, fx.Node) and a.op == "call_function" and a.target is aten.exp.default:
        return a.args[0] if isinstance(a.args[0], fx.Node) else None
    return None


def _contraction(readout: fx.GraphModule) -> Optional[fx.Node]:
    """The readout's only use of the state (placeholder 0): ``einsum("...pn,...n->...p", h, C)``
    with ``C`` (batch, time, heads, N)."""
    h = next((n for n in readout.graph.nodes if n.op == "placeholder"), None)
    if h is None or len(h.users) != 1:
        return None
    (use,) = h.users
    if use.op != "call_function" or use.target is not aten.einsum.default:
        return None
    eq, ops = use.args[0], use.args[1]
    if len(ops) != 2 or ops[0] is not h or not isinstance(eq, str):
        return None
    lhs, _, out = eq.replace(" ", "").partition("->")
    sh, sc = (lhs.split(",") + [""])[:2]
    if len(sh) != 5 or len(set(sh)) != 5 or sc != sh[:3] + sh[4] or out != sh[:4]:
        return None
    hs, cs = _shape(h), _shape(ops[1])
    if hs is None or cs != hs[:3] + hs[4:]:
        return None
    return use


def match_chunked_form(producer: fx.GraphModule, readout: fx.GraphModule, scan: ScanSpec, io: RegionIO) -> Optional[ChunkedForm]:
    """The region's :class:`ChunkedForm`, or None when its graphs are not that form (a per-channel
    decay, a state read otherwise than by the contraction, time not at dim 1, ...)."""
    if scan.kind != "diagonal" or scan.rank != 5 or scan.time_dim != 1:
        return None
    merged = io.producer_merged or (None,) * len(io.producer_time_dims)
    if any(m is not None for m in merged[:2]) or io.producer_time_dims[1] != 1:
        return None
    _, vals = _outputs(producer)
    factors = _outer_factors(vals[1])
    if factors is None or len(vals[1].users) != 1:  # u is used only as the output
        return None
    us = _shape(vals[1])
    if scan.has_a:
        if _shape(vals[0]) != us[:3] + (1, 1) or io.producer_time_dims[0] != 1:
            return None
    if scan.has_h0 and _shape(vals[2]) != (us[0],) + us[2:]:
        return None
    use = _contraction(readout)
    if use is None or _shape(use.args[1][1]) != us[:3] + us[4:]:
        return None
    z = _log_decay(vals[0]) if scan.has_a else None
    return ChunkedForm(chunk=chunk_for(us[3], us[4]), head_dim=us[3], d_state=us[4],
                       x_arg=0 if factors[0] is vals[1].args[0] else 1,
                       log_decay=z is not None and _shape(z) == us[:3])


def _attr(gm: fx.GraphModule, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), gm)


def chunked_shard_graph(producer: fx.GraphModule, readout: fx.GraphModule, form: ChunkedForm, io: RegionIO,
                        start: int, steps: int, *, state_in: bool, has_h0: bool,
                        backend: Optional[str]) -> fx.GraphModule:
    """One shard as one graph: ``(*window inputs[, h_start]) -> (*readout outputs, h_end)``.

    ``producer`` runs on the window (already at its length), ``readout`` on the shard's ``steps``
    (ditto); producer outputs are trimmed (``io``: their time dims) to the window's steps ``[start, start + steps)``. The state enters as ``h_start`` (``state_in``), else as the
    producer's ``h0`` (``has_h0``), else as zero; ``h_end`` is in the canonical state layout
    ``(batch, heads, head_dim, d_state)``.
    """
    g = fx.Graph()
    attrs: dict[str, Any] = {}

    def copier(gm: fx.GraphModule, env: dict[fx.Node, Any], prefix: str):
        """Copy a node of ``gm`` into ``g``, its inputs looked up in ``env`` (get_attr targets kept)."""
        def copy(n: fx.Node) -> fx.Node:
            new = g.node_copy(n, lambda a: env[a])
            if n.op == "get_attr":
                obj = _attr(gm, n.target)
                if attrs.get(n.target, obj) is not obj:
                    new.target = f"{prefix}_{n.target.replace('.', '_')}"
                attrs[new.target] = obj
            env[n] = new
            return new
        return copy

    penv: dict[fx.Node, Any] = {}
    copy_p = copier(producer, penv, "producer")
    for n in producer.graph.nodes:
        if n.op == "placeholder":
            copy_p(n)
    h_start = g.placeholder("h_start") if state_in else None
    for n in producer.graph.nodes:
        if n.op not in ("placeholder", "output"):
            copy_p(n)
    _, vals = _outputs(producer)
    xe, be = vals[1].args[form.x_arg], vals[1].args[1 - form.x_arg]

    def trimmed(n: Any, dim: Optional[int], merged: Optional[tuple[int, int]] = None) -> Any:
        if not isinstance(n, fx.Node) or dim is None:
            return penv.get(n, n)
        return g.call_function(trim, (penv[n], dim, merged, start, steps))

    merged = io.producer_merged or (None,) * len(io.producer_time_dims)
    rs = [trimmed(v, d, m) for v, d, m in zip(vals[3:], io.producer_time_dims[3:], merged[3:])]
    x = g.call_function(aten.squeeze.dim, (trimmed(xe, 1), -1))
    b = g.call_function(aten.squeeze.dim, (trimmed(be, 1), -2))
    state = h_start if h_start is not None else penv[vals[2]] if has_h0 else None  # (b, H, P, N) or zero
    item = lambda t, i: g.call_function(operator.getitem, (t, i))  # noqa: E731

    def emit(c: fx.Node) -> tuple[fx.Node, fx.Node]:
        """``(y, h_end)`` of the shard's steps, ``y`` (b, steps, H, P) as the contraction's."""
        if form.log_decay:
            res = g.call_function(ssd_chunk_scan, (trimmed(_log_decay(vals[0]), 1), x, b, c, state, form.chunk))
            return item(res, 0), item(res, 1)
        perm = lambda t: g.call_function(aten.permute.default, (t, [0, 2, 1, 3]))  # noqa: E731
        decay = None
        if vals[0] is not None:  # (b, steps, H, 1, 1) -> (b, H, steps)
            a = g.call_function(aten.squeeze.dim, (g.call_function(aten.squeeze.dim, (trimmed(vals[0], 1), -1)), -1))
            decay = g.call_function(aten.permute.default, (a, [0, 2, 1]))
        s0 = None if state is None else g.call_function(aten.transpose.int, (state, -1, -2))  # S = h^T
        res = g.call_function(torch.ops.gradshard.lightning_attention.default,
                              (perm(c), perm(b), perm(x), decay, s0, form.chunk, backend))
        return perm(item(res, 0)), g.call_function(aten.transpose.int, (item(res, 1), -1, -2))

    placeholders = [n for n in readout.graph.nodes if n.op == "placeholder"]
    renv: dict[fx.Node, Any] = dict(zip(placeholders[1:], rs))
    copy_r = copier(readout, renv, "readout")
    h_end = None
    for n in readout.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            outs = n.args[0] if isinstance(n.args[0], (tuple, list)) else [n.args[0]]
            g.output((*[renv[o] if isinstance(o, fx.Node) else o for o in outs], h_end))
            break
        if n.target is aten.einsum.default and n.args[1][0] is placeholders[0]:  # y = h C: the chunked shard
            y, h_end = emit(renv[n.args[1][1]])
            renv[n] = g.call_function(_as_contraction, (y, n.meta["val"].dtype if "val" in n.meta else None))
            continue
        copy_r(n)
    g.eliminate_dead_code()
    return fx.GraphModule(attrs, g, class_name="ChunkedShard")


def _as_contraction(y: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``y`` as the contraction returned it: dense in its own layout (later views of the readout
    assume so) and in its dtype (the op computes in its inputs' promoted dtype)."""
    return y.to(dtype or y.dtype).contiguous()
