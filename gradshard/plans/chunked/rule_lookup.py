"""Look up the chunk rule of a node in :data:`~gradshard.plans.chunked.rules.CHUNK_RULES`.

The table is filled by the built-in rule sets imported here: ``rules_local`` (pointwise,
views, reductions over non-time dims, ...) and ``rules_mixing`` (ops that mix time steps:
attention, scans, convolutions, ...), ``rules_solve`` (triangular solves) and ``rules_loop`` (carried loops). A plugin adds rules with
:func:`~gradshard.plans.chunked.rules.register_chunk_rule`.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from gradshard.errors import node_error
from gradshard.plans.chunked import rules_local, rules_loop, rules_mixing, rules_solve  # noqa: F401  (the built-in rule sets)
from gradshard.plans.chunked.rules import CHUNK_RULES, BuildCtx, NodeRule, op_name, default_run, slots_of

__all__ = ["build_rule"]


def build_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """The :class:`NodeRule` of a ``call_function`` node (raises if its time use is unsafe)."""
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    builder = CHUNK_RULES.get(packet) if packet is not None else CHUNK_RULES.get(target)
    qual = getattr(packet, "_qualified_op_name", None)
    if builder is None and qual is not None:
        builder = CHUNK_RULES.get(qual)
    has_time = any(bc.frame(a) for a in slots_of(node))
    if builder is None and packet is not None and torch.Tag.pointwise in getattr(target, "tags", ()):
        builder = CHUNK_RULES["pointwise"]  # any op tagged pointwise (chunk_rules_local)
    if builder is None:
        if not has_time and not (node.name in bc.tl.info and bc.tl[node].time_dims):
            return NodeRule((), tuple(None for _ in slots_of(node)), default_run)
        raise node_error(node, f"gradshard does not know how `{qual or op_name(node)}` reads the time "
                         "axis, so it cannot run it one chunk at a time",
                         "register a rule with gradshard.plans.chunked.rules.register_chunk_rule, or "
                         "use plan='none'")
    if not has_time and not getattr(builder, "factory", False):
        return NodeRule((), tuple(None for _ in slots_of(node)), default_run)
    return builder(node, bc)
