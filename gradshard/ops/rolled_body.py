"""Rolled loop bodies: a per-timestep fx graph applied to every step at once with ``vmap``.

``roll_loops`` replaces an unrolled per-timestep loop by (1) one :class:`RolledBody` that
computes the state-independent per-step values (``a_t``, ``u_t``, readout inputs) for all
steps, (2) one scan node, and (3) one :class:`RolledBody` for the readout. Bodies hold no
sequence length, so the rolled program runs at any length. In the graph they appear as
``run_rolled_body(get_attr(body), *inputs)`` (a plain call_function node whose time
dims rule is registered below: per step, so pointwise in time; each output's time dim is the
one its ``out_dims`` names, unified with the inputs' time dims).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn

from gradshard.analysis.dims import DimsContext, NodeDims, analyze_dims, register_dim_rule
from gradshard.ops.dense_scan import is_scan_op

__all__ = ["RolledBody", "run_rolled_body"]


class RolledBody(nn.Module):
    """``vmap(body, in_dims, out_dims)`` over the time axis.

    ``in_dims[i]``: the time dim of input i (``None``: the same for every step);
    ``out_dims[j]``: where output j's time dim goes.
    """

    def __init__(self, body: fx.GraphModule, in_dims: Sequence[Optional[int]], out_dims: Sequence[int],
                 description: str = "") -> None:
        super().__init__()
        self.body = body
        self.in_dims = tuple(in_dims)
        self.out_dims = tuple(out_dims)
        self.description = description

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        if all(d is None for d in self.in_dims):
            raise RuntimeError("RolledBody: no input carries the time axis")
        outs = torch.func.vmap(self._call, in_dims=self.in_dims, out_dims=self.out_dims)(*args)
        return tuple(outs)

    def _call(self, *args: Any) -> tuple[torch.Tensor, ...]:
        out = self.body(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def extra_repr(self) -> str:
        return f"in_dims={self.in_dims}, out_dims={self.out_dims}" + (f", {self.description}" if self.description else "")


def run_rolled_body(body: RolledBody, *args: Any) -> tuple[torch.Tensor, ...]:
    """Graph-level entry point for a rolled body (see the module doc)."""
    return body(*args)


@register_dim_rule(run_rolled_body)
def _rolled_body_rule(node: fx.Node, ctx: DimsContext) -> tuple[NodeDims | None, ...]:
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
