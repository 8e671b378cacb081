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
shard's block tensors, never its per-step states. The truncated adjoint runs the same shards
with a second readout of the states that removes, at each step, the gradient of the step a
window later (:class:`~gradshard.plans.adjoint.truncated.ChunkedTruncation`).

:func:`match_chunked_form` recognises the form on the region's captured graphs by structure
and shape (a product of ``x[..., None]`` and ``B[..., None, :]`` as ``u``; ``a`` broadcast over
the state; the state read only by that contraction), not by model; :func:`chunked_shard_graph`
builds the shard graph at a window length.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.ir import graph_module
from gradshard.ops.lightning import block_scan, decay_per_head
from gradshard.analysis.outer_scan import (
    block_length, decays_over_state, log_decay, log_decay_per_step, node_shape, outer_left, state_contraction)
from gradshard.plans.adjoint.layout import RegionIO, ScanSpec, trim

__all__ = ["ChunkedForm", "match_chunked_form", "chunked_shard_graph", "block_form_flops"]

aten = torch.ops.aten


@dataclass(frozen=True)
class ChunkedForm:
    """A region runs its shards chunked (:mod:`gradshard.plans.adjoint.chunked`).

    The state ``h`` (batch, heads, d1, d2) is ``left right^T`` summed with decay, ``left`` (.., d1)
    and ``right`` (.., d2) the factors of ``u``; the readout contracts one state dim (the *keys*)
    with a per-step query and returns the other (the *values*): SSD's ``h (P, N)`` read by ``C``
    over ``N`` (``contracted=-1``), or linear attention's ``S (dk, dv)`` read by ``q`` over ``dk``
    (``contracted=-2``)."""

    chunk: int  # block length
    keys: int
    values: int
    left_arg: int  # which argument of the product ``u = left[..., None] * right[..., None, :]`` is ``left``
    contracted: int  # -1 or -2: the state dim the readout contracts
    query_arg: int  # which einsum operand is the query
    #: ``a = exp(z)``: the shard computes SSD's block form from ``z``
    #: (:func:`gradshard.kernels.ssd_torch.ssd_chunk_scan`, plain ops a compiler fuses); else the
    #: ``gradshard::lightning_attention`` op on the decay itself
    log_decay: bool = False

    def describe(self) -> str:
        how = "SSD block form from the log-decay" if self.log_decay else "gradshard::lightning_attention"
        return (f"shards run chunked ({how}, blocks of {self.chunk}; the {self.values}x{self.keys} state "
                "per head is never formed per step)")


def _outputs(gm: fx.GraphModule) -> tuple[fx.Node, list[Any]]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = out.args[0]
    return out, (list(vals) if isinstance(vals, (tuple, list)) else [vals])


def _contraction(readout: fx.GraphModule) -> Optional[tuple[fx.Node, int, int]]:
    """``(einsum, contracted, query_arg)`` when the readout's only use of the state (placeholder 0)
    is a contraction with a per-step query (:func:`~gradshard.analysis.outer_scan.state_contraction`)."""
    h = next((n for n in readout.graph.nodes if n.op == "placeholder"), None)
    if h is None or len(h.users) != 1:
        return None
    (use,) = h.users
    found = state_contraction(use, h)
    return None if found is None else (use, *found)


def match_chunked_form(producer: fx.GraphModule, readout: fx.GraphModule, scan: ScanSpec, io: RegionIO) -> Optional[ChunkedForm]:
    """The region's :class:`ChunkedForm`, or None when its graphs are not that form (a per-channel
    decay, a state read otherwise than by one contraction, time not at dim 1, ...)."""
    if scan.kind != "diagonal" or scan.rank != 5 or scan.time_dim != 1:
        return None
    merged = io.producer_merged or (None,) * len(io.producer_time_dims)
    if any(m is not None for m in merged[:2]) or io.producer_time_dims[1] != 1:
        return None
    _, vals = _outputs(producer)
    left = outer_left(vals[1])
    if left is None or len(vals[1].users) != 1:  # u is used only as the output
        return None
    us = node_shape(vals[1])
    if scan.has_a and not decays_over_state(vals[0], us, io.producer_time_dims[0]):
        return None
    if scan.has_h0 and node_shape(vals[2]) != (us[0],) + us[2:]:
        return None
    found = _contraction(readout)
    if found is None:
        return None
    _, contracted, query_arg = found
    return ChunkedForm(chunk=block_length(us[3], us[4]), keys=us[contracted], values=us[-3 - contracted],
                       left_arg=left, contracted=contracted, query_arg=query_arg,
                       log_decay=scan.has_a and log_decay_per_step(vals[0]))


def block_form_flops(form: ChunkedForm, batch: int, steps: int, heads: int, decay: bool) -> tuple[int, int]:
    """``(forward, backward)`` FLOPs of the block form over ``steps`` steps from an initial state,
    counted by ``torch.utils.flop_counter`` on meta tensors (shapes only, nothing allocated)."""
    from torch.utils.flop_counter import FlopCounterMode

    def t(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, device="meta", requires_grad=True)

    x, k, q = t(batch, steps, heads, form.values), t(batch, steps, heads, form.keys), t(batch, steps, heads, form.keys)
    state = t(batch, heads, form.values, form.keys) if form.contracted == -1 else t(batch, heads, form.keys, form.values)
    with FlopCounterMode(display=False) as counter:
        y, h = block_scan(t(batch, steps, heads) if decay or form.log_decay else None, form.log_decay, x, k, q, state,
                          form.contracted, form.chunk)
        forward = counter.get_total_flops()
        torch.autograd.backward((y, h), (torch.ones_like(y), torch.ones_like(h)))
    return forward, counter.get_total_flops() - forward


def chunked_shard_graph(producer: fx.GraphModule, readout: fx.GraphModule, form: ChunkedForm, io: RegionIO,
                        start: int, steps: int, *, state_in: bool, has_h0: bool,
                        backend: Optional[str], truncated: Optional[str] = None) -> fx.GraphModule:
    """One shard as one graph: ``(*window inputs[, h_start]) -> (*readout outputs, h_end)``.

    ``producer`` runs on the window (already at its length), ``readout`` on the shard's ``steps``
    (ditto); producer outputs are trimmed (``io``: their time dims) to the window's steps
    ``[start, start + steps)``. The state enters as ``h_start`` (``state_in``), else as the
    producer's ``h0`` (``has_h0``), else as zero; ``h_end`` is in the region's canonical state
    layout ``(batch, heads, d1, d2)``.

    ``truncated`` (the truncated adjoint's backward, :class:`~gradshard.plans.adjoint.truncated.ChunkedTruncation`):
    ``"keep"`` adds the input ``probe`` (zeros added to the contraction's output, so that its
    gradient is the output's) and the outputs ``query`` and ``a`` (per head and step; None without
    a decay), detached; ``"correct"`` also the input ``query_next`` and the output ``y2``, the same
    states read by it (:func:`block_scan`'s second readout).
    """
    g = fx.Graph()
    attrs: dict[str, Any] = {}

    def copier(gm: fx.GraphModule, env: dict[fx.Node, Any], prefix: str):
        """Copy a node of ``gm`` into ``g``, its inputs looked up in ``env`` (get_attr targets kept)."""
        def copy(n: fx.Node) -> fx.Node:
            new = g.node_copy(n, lambda a: env[a])
            if n.op == "get_attr":
                obj = operator.attrgetter(n.target)(gm)
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
    probe = g.placeholder("probe") if truncated else None
    query_next = g.placeholder("query_next") if truncated == "correct" else None
    for n in producer.graph.nodes:
        if n.op not in ("placeholder", "output"):
            copy_p(n)
    _, vals = _outputs(producer)
    a_dim = io.producer_time_dims[0] if vals[0] is not None else None

    def trimmed(n: Any, dim: Optional[int], merged: Optional[tuple[int, int]] = None) -> Any:
        if not isinstance(n, fx.Node) or dim is None:
            return penv.get(n, n)
        return g.call_function(trim, (penv[n], dim, merged, start, steps))

    merged = io.producer_merged or (None,) * len(io.producer_time_dims)
    rs = [trimmed(v, d, m) for v, d, m in zip(vals[3:], io.producer_time_dims[3:], merged[3:])]
    call = lambda f, *args: g.call_function(f, args)  # noqa: E731
    left = call(aten.squeeze.dim, trimmed(vals[1].args[form.left_arg], 1), -1)  # (b, steps, H, d1)
    right = call(aten.squeeze.dim, trimmed(vals[1].args[1 - form.left_arg], 1), -2)  # (b, steps, H, d2)
    values, keys = (left, right) if form.contracted == -1 else (right, left)
    state = h_start if h_start is not None else penv[vals[2]] if has_h0 else None  # (b, H, d1, d2) or zero

    extra: list[Any] = []  # the truncated adjoint's outputs

    def emit(query: fx.Node) -> tuple[fx.Node, fx.Node]:
        """``(y, h_end)`` of the shard's steps: ``y`` (b, steps, H, values) as the contraction's."""
        decay = None
        if form.log_decay:
            decay = call(decay_per_head, trimmed(log_decay(vals[0]), a_dim), values, 0)
        elif vals[0] is not None:
            decay = call(decay_per_head, trimmed(vals[0], a_dim), values, 2)
        res = g.call_function(block_scan, (decay, form.log_decay, values, keys, query, state, form.contracted,
                                           form.chunk, backend, query_next))
        y = call(operator.getitem, res, 0)
        if truncated:
            a = None if decay is None else call(aten.exp.default, decay) if form.log_decay else decay
            extra.extend([call(aten.detach.default, query), None if a is None else call(aten.detach.default, a),
                          call(operator.getitem, res, 2) if query_next is not None else None])
            y = call(aten.add.Tensor, y, probe)
        return y, call(operator.getitem, res, 1)

    placeholders = [n for n in readout.graph.nodes if n.op == "placeholder"]
    renv: dict[fx.Node, Any] = dict(zip(placeholders[1:], rs))
    copy_r = copier(readout, renv, "readout")
    h_end = None
    for n in readout.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            outs = n.args[0] if isinstance(n.args[0], (tuple, list)) else [n.args[0]]
            g.output((*[renv[o] if isinstance(o, fx.Node) else o for o in outs], h_end, *extra))
            break
        if n.target is aten.einsum.default and placeholders[0] in n.args[1]:  # the contraction: the block form
            y, h_end = emit(renv[n.args[1][form.query_arg]])
            renv[n] = call(_as_contraction, y, n.meta["val"].dtype if "val" in n.meta else None)
            continue
        copy_r(n)
    g.eliminate_dead_code()
    return graph_module(attrs, g, "ChunkedShard")


def _as_contraction(y: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``y`` as the contraction returned it: dense in its own layout (later views of the readout
    assume so) and in its dtype (the op computes in its inputs' promoted dtype)."""
    return y.to(dtype or y.dtype).contiguous()
