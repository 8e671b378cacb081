"""Teach the dims/time analyses about the ops recurrence passes put in graphs.

* ``gradshard::linear_scan`` (the kernel): output dims are ``u``'s; reads all of the past.
* ``gradshard::dense_linear_scan`` (rolled dense loops): output dims are ``u``'s.
* ``run_rolled_body`` (rolled loop bodies): per-step, so pointwise in time; each output's
  time dim is the one named by the body's ``out_dims``, unified with the inputs' time dims.

Importing this module registers the rules (idempotent).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from gradshard.analysis import locality
from gradshard.analysis.dims import NodeDims, _Ctx, register_dim_rule
from gradshard.runtime.adjoint_loops import run_rolled_body
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
    outs: list[NodeDims | None] = []
    for v, od in zip(vals, body.out_dims):
        if not isinstance(v, torch.Tensor):
            outs.append(None)
            continue
        dims = list(ctx.fresh_dims(v.shape))
        if od < len(dims) and time_labels:
            dims[od] = frozenset(time_labels)
        outs.append(NodeDims(tuple(dims)))
    return tuple(outs)


def is_scan_op(node: fx.Node) -> bool:
    """Whether ``node`` calls the gradshard diagonal or dense scan op."""
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet, "_qualified_op_name", None) in (LINEAR_SCAN, DENSE_SCAN)
