"""Dimension provenance: which input dimensions each output dimension of a node comes from.

Every dimension of every graph input gets an integer label. A rule per aten op (the
``DIM_RULES`` table, keyed by ``OpOverloadPacket``) maps the labels of a node's inputs to
the labels of its output dimensions: views split and merge dims by matching size products,
transposes permute them, matmuls drop contracted dims, pointwise ops unify broadcast dims.
Labels that meet in one output dimension (``x + y`` with both time-shaped) are merged with
a union-find, so "the time axis" becomes one equivalence class spanning inputs (token ids,
labels, position ids) and every intermediate that carries it.

Per-timestep Python loops unroll into ``select(x, t_dim, i)`` chains that are stacked back
together; ``select`` remembers which label it removed (``NodeDims.selected``) and
``stack``/``cat`` of such pieces gives the new dimension that label again.

Unknown ops get fresh labels and are listed in ``DimAnalysis.opaque`` so later analyses
treat them conservatively.

The records, the rule context and the rule table are in :mod:`.dim_core`; the aten rules in
:mod:`.dim_rules_layout` and :mod:`.dim_rules_compute`, imported here so the table is full
whenever the analysis runs. Custom ops register their rules next to their definition.
"""

from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx

from . import dim_rules_compute, dim_rules_layout  # noqa: F401  (fill DIM_RULES with the aten rules)
from .dim_core import DIM_RULES, DimAnalysis, DimsContext, NodeDims, pointwise_rule, register_dim_rule, shape_of

__all__ = ["NodeDims", "DimsContext", "DimAnalysis", "analyze_dims", "DIM_RULES", "register_dim_rule", "shape_of"]


def _custom_op_rule(node: fx.Node, ctx: DimsContext) -> NodeDims | tuple[NodeDims | None, ...] | None:
    """gradshard custom ops describe their dims next to their definition (``gs_dims`` attr)."""
    packet = getattr(node.target, "_overloadpacket", None)
    fn = DIM_RULES.get(packet) or DIM_RULES.get(getattr(packet, "_qualified_op_name", None))
    return fn(node, ctx) if fn else None


def analyze_dims(gm: fx.GraphModule) -> DimAnalysis:
    """Label every dimension of every node with the graph-input dimensions it comes from."""
    analysis = DimAnalysis(nodes={}, classes=nx.utils.UnionFind(), input_labels={})
    counter = [0]
    ctx = DimsContext(analysis, counter)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            shp = shape_of(node) or ()
            labs = []
            for _ in shp:
                labs.append(ctx.fresh())
            analysis.input_labels[node.name] = tuple(labs)
            analysis.nodes[node.name] = NodeDims(tuple(frozenset([l]) for l in labs))
            continue
        if node.op == "output":
            continue
        result = _apply_rule(node, ctx)
        if result is None:
            vals = node.meta.get("val")
            if isinstance(vals, torch.Tensor):
                result = NodeDims(ctx.fresh_dims(vals.shape))
                if node.all_input_nodes:
                    analysis.opaque.append(node.name)
            elif isinstance(vals, (tuple, list)):
                result = tuple(NodeDims(ctx.fresh_dims(v.shape)) if isinstance(v, torch.Tensor) else None for v in vals)
                if node.all_input_nodes:
                    analysis.opaque.append(node.name)
        if result is not None:
            analysis.nodes[node.name] = result
    return analysis


def _apply_rule(node: fx.Node, ctx: DimsContext):
    if node.op != "call_function":
        return None
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    rule = DIM_RULES.get(packet) if packet is not None else DIM_RULES.get(target)
    if rule is None and packet is not None and torch.Tag.pointwise in getattr(target, "tags", ()):
        rule = pointwise_rule
    if rule is None and packet is not None:
        return _custom_op_rule(node, ctx)
    if rule is None:
        return None
    return rule(node, ctx)

