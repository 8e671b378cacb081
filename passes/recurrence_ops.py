"""Teach the dims/time analyses about the ops recurrence passes put in graphs.

* ``gradshard::linear_scan`` (the kernel): output dims are ``u``'s; reads all of the past.
* ``gradshard::dense_linear_scan`` (rolled dense loops): output dims are ``u``'s.
* ``run_rolled_body`` (rolled loop bodies): per-step, so pointwise in time; each output's
  time dim is the one named by the body's ``out_dims``, unified with the inputs' time dims;
  a readout body's output that is a per-step function of the state alone, dim for dim (the
  dims analysis of the body graph), takes the state sequence's dims, so ``hs.append(2 * h)``
  keeps the state dims of ``h``; other outputs get fresh labels.

Importing this module registers the rules (idempotent).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from gradshard.analysis import locality
from gradshard.analysis.dims import NodeDims, _Ctx, register_dim_rule
from gradshard.runtime.adjoint_loops import RolledBody, run_rolled_body
from gradshard.runtime.adjoint_scan import dense_linear_scan  # noqa: F401  (registers the op)

__all__ = ["DENSE_SCAN", "LINEAR_SCAN"]

LINEAR_SCAN = "gradshard::linear_scan"
DENSE_SCAN = "gradshard::dense_linear_scan"

locality.CUSTOM_TIME_OPS.setdefault(LINEAR_SCAN, (1, locality.ALL_PAST))
locality.CUSTOM_TIME_OPS.setdefault(DENSE_SCAN, (1, locality.ALL_PAST))


def _scan_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    a, u = node.args[0], node.args[1]
    ud = ctx.dims(u)
    ad = ctx.dims(a)
    if len(ad) == len(ud) and ad:
        ctx.union(ad[1] | ud[1])  # a and u share the time axis
    return NodeDims(tuple(ud), frozenset())


register_dim_rule(torch.ops.gradshard.linear_scan, LINEAR_SCAN)(_scan_rule)
register_dim_rule(torch.ops.gradshard.dense_linear_scan, DENSE_SCAN)(_scan_rule)


@register_dim_rule(run_rolled_body)
def _rolled_body_rule(node: fx.Node, ctx: _Ctx) -> tuple[NodeDims | None, ...]:
    """Outputs: time at ``out_dims[j]`` (same class as every mapped input's time dim)."""
    body_node = node.args[0]
    module = node.graph.owning_module
    body = module.get_submodule(body_node.target) if isinstance(body_node, fx.Node) and module is not None else None
    vals = node.meta.get("val") or ()
    if body is None:
        return tuple(NodeDims(ctx.fresh_dims(v.shape)) if isinstance(v, torch.Tensor) else None for v in vals)
    time_labels: set[int] = set()
    for arg, d in zip(node.args[1:], body.in_dims):
        if d is None or not isinstance(arg, fx.Node):
            continue
        dims = ctx.dims(arg)
        if d < len(dims):
            time_labels |= set(dims[d])
    ctx.union(time_labels)
    sources = _body_dim_sources(body)
    outs: list[NodeDims | None] = []
    for j, (v, od) in enumerate(zip(vals, body.out_dims)):
        if not isinstance(v, torch.Tensor):
            outs.append(None)
            continue
        dims = list(ctx.fresh_dims(v.shape))
        src = sources[j] if sources and j < len(sources) else None
        first = node.args[1] if len(node.args) > 1 else None
        if (src and all(x == (0, k) for k, x in enumerate(src)) and _is_state_sequence(first)
                and body.in_dims[0] == od and tuple(first.meta["val"].shape) == tuple(v.shape)):
            # a readout body's per-step function of the state alone, dim for dim (``2 * h_t`` of a
            # stacked state): the output has the state sequence's dims (others keep fresh labels)
            dims = list(ctx.dims(first))
        if od < len(dims) and time_labels:
            dims[od] = frozenset(time_labels)
        outs.append(NodeDims(tuple(dims)))
    return tuple(outs)


def _per_step_inputs(node: fx.Node, placeholders: list[fx.Node]) -> set[int]:
    """Indices of the body placeholders ``node`` depends on."""
    index = {p: i for i, p in enumerate(placeholders)}
    seen: set[fx.Node] = set()
    stack, found = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in index:
            found.add(index[n])
        stack.extend(n.all_input_nodes)
    return found


def _is_state_sequence(n: object) -> bool:
    """``n`` is a scan's output (possibly squeezed back from a dense vector state)."""
    if isinstance(n, fx.Node) and n.target is torch.ops.aten.squeeze.dim:
        n = n.args[0]
    return isinstance(n, fx.Node) and is_scan_op(n)


def _body_dim_sources(body: RolledBody) -> Optional[list[Optional[list[Optional[tuple[int, int]]]]]]:
    """For each body output, per (per-step) dim: the ``(input index, input dim)`` it comes from, by
    the dims analysis of the body graph (``2 * h_t`` keeps ``h_t``'s state dims); cached on the body."""
    cached = getattr(body, "_gs_dim_sources", False)
    if cached is not False:
        return cached
    from gradshard.analysis.dims import analyze_dims

    result: Optional[list[Optional[list[Optional[tuple[int, int]]]]]] = None
    try:
        ana = analyze_dims(body.body)
    except Exception:  # a body op without a dims rule: outputs keep fresh labels
        ana = None
    if ana is not None:
        where: dict[int, tuple[int, int]] = {}
        placeholders = [n for n in body.body.graph.nodes if n.op == "placeholder"]
        for i, ph in enumerate(placeholders):
            for m, lab in enumerate(ana.input_labels.get(ph.name, ())):
                where.setdefault(ana.canon(lab), (i, m))
        out = next(iter(body.body.graph.find_nodes(op="output"))).args[0]
        per_step = {i for i, d in enumerate(body.in_dims) if d is not None}
        result = []
        for o in out if isinstance(out, (tuple, list)) else (out,):
            nd = ana.dims_of(o) if isinstance(o, fx.Node) else None
            if nd is None or not isinstance(nd, NodeDims) or _per_step_inputs(o, placeholders) & per_step != {0}:
                result.append(None)  # unknown, or it reads another per-step input than the state
                continue
            per: list[Optional[tuple[int, int]]] = []
            for labels in nd.dims:
                found = {where.get(ana.canon(lab)) for lab in labels} - {None}
                per.append(next(iter(found)) if len(found) == 1 else None)
            result.append(per)
    body._gs_dim_sources = result
    return result


def is_scan_op(node: fx.Node) -> bool:
    """Whether ``node`` calls the gradshard diagonal or dense scan op."""
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet, "_qualified_op_name", None) in (LINEAR_SCAN, DENSE_SCAN)
