"""Graph facts the plan rules need, read off the captured graph symbolically.

A node's size becomes a sympy expression by the dimension provenance of
:mod:`gradshard.analysis.dims`: a dimension whose labels belong to the time class scales
with ``T``, one in the batch class with ``B``, any other keeps its size. So a
``(B, H, T, d)`` key tensor of float32 is ``16·B·T·H·d/16 = 4·H·d·B·T`` bytes whatever the
example sizes were.

Facts (names a :class:`~gradshard.cost.rules.PlanRule` lists in ``needs``):

- ``linear_attention_state_bytes``: the bytes of one recurrent state ``B·H·dk·dv`` summed
  over the linear-attention layers (what LASP relays between ranks), from the
  ``state_bytes`` of the compiler's ``linear_attention`` regions or the state outputs of
  ``gradshard.kernels.lightning_attention``;
- ``linear_attention_state_elements``: the same in elements (``B·H·dk·dv`` summed).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ..analysis.dims import DimAnalysis, analyze_dims
from ..analysis.locality import infer_time_class
from ..capture import capture
from ..errors import GradshardError
from .fit import B, T
from .probe import InputAxes, fake_clone

__all__ = ["graph_facts", "symbolic_numel", "symbolic_bytes", "FACTS"]


def symbolic_numel(shape: Sequence[int], labels: Sequence[Iterable[int]], dims: DimAnalysis, time_cls: int | None,
                   batch_cls: int | None, seq_len: int, batch: int) -> sympy.Expr:
    """``prod(shape)`` with time-class dims scaled to ``T`` and batch-class dims to ``B``."""
    out: sympy.Expr = sympy.Integer(1)
    for size, labs in zip(shape, labels):
        classes = {dims.canon(l) for l in labs}
        factor: sympy.Expr = sympy.Integer(size)
        if time_cls is not None and time_cls in classes and seq_len:
            factor = factor * T / seq_len
        if batch_cls is not None and batch_cls in classes and batch:
            factor = factor * B / batch
        out = out * factor
    return out


def symbolic_bytes(val: torch.Tensor, labels: Sequence[Iterable[int]], dims: DimAnalysis, time_cls: int | None,
                   batch_cls: int | None, seq_len: int, batch: int) -> sympy.Expr:
    return symbolic_numel(tuple(val.shape), labels, dims, time_cls, batch_cls, seq_len, batch) * val.element_size()


def _qualname(node: fx.Node) -> str | None:
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet, "_qualified_op_name", None)


def _linear_attention_state_bytes(gm: fx.GraphModule, dims: DimAnalysis, time_cls: int, batch_cls: int | None,
                                  axes: InputAxes, regions: Sequence[Any], region_batch: int) -> sympy.Expr:
    """Bytes of one KV state per layer, summed: the compiler's ``linear_attention`` regions
    (``state_bytes`` at the batch they were found at), else the state outputs of
    ``gradshard.kernels.lightning_attention`` calls (``(B, H, dk, dv)``, batch first)."""
    found = [r for r in regions if r.kind == "linear_attention" and "state_bytes" in r.options]
    if found:
        return sum((sympy.Integer(int(r.options["state_bytes"])) * B / region_batch for r in found), sympy.Integer(0))
    return _kernel_states(gm, dims, time_cls, batch_cls, axes, elements=False)


def _linear_attention_state_elements(gm: fx.GraphModule, dims: DimAnalysis, time_cls: int, batch_cls: int | None,
                                     axes: InputAxes, regions: Sequence[Any], region_batch: int) -> sympy.Expr:
    """Elements ``B·H·dk·dv`` of one KV state per layer, summed (see the bytes above)."""
    found = [r for r in regions if r.kind == "linear_attention" and {"heads", "dk", "dv"} <= set(r.options)]
    if found:
        return sum((B * int(r.options["heads"]) * int(r.options["dk"]) * int(r.options["dv"]) for r in found),
                   sympy.Integer(0))
    return _kernel_states(gm, dims, time_cls, batch_cls, axes, elements=True)


def _kernel_states(gm: fx.GraphModule, dims: DimAnalysis, time_cls: int, batch_cls: int | None, axes: InputAxes,
                   *, elements: bool) -> sympy.Expr:
    total: sympy.Expr = sympy.Integer(0)
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and _qualname(node) == "gradshard::lightning_attention":
            vals = node.meta.get("val")
            if not (isinstance(vals, (tuple, list)) and len(vals) > 1 and isinstance(vals[1], torch.Tensor)):
                continue
            state = vals[1]  # (B, H, dk, dv) by the kernel's contract (docs/DESIGN.md): batch first
            q = dims.dims_of(node.args[0])
            labels = [q.dims[0]] + [()] * (state.dim() - 1) if q is not None and q.dims else [()] * state.dim()
            per = symbolic_bytes(state, labels, dims, time_cls, batch_cls, axes.seq_len, axes.batch_size)
            if elements:
                per = per / state.element_size()
            if not per.has(B) and batch_cls is not None and state.shape[0] == axes.batch_size:
                per = per * B / axes.batch_size
            total += per
            count += 1
    if not count:
        raise GradshardError(
            "the LASP cost rule needs the linear-attention state size (B*H*dk*dv per layer), but the compiled "
            "plan reported no linear_attention region and the graph has no gradshard.kernels.lightning_attention "
            "call.\n  instead: check `gradshard show` for the plan's regions (LASP needs linear attention).")
    return total


FACTS = ("linear_attention_state_bytes", "linear_attention_state_elements")


def graph_facts(target: Any, example_inputs: Sequence[Any], axes: InputAxes, needs: Iterable[str], *,
                time_axis: tuple[int, int] | None = None, frontend: str = "python",
                dtype: torch.dtype | None = None, regions: Sequence[Any] = (),
                region_batch: int = 1) -> dict[str, sympy.Expr]:
    """Compute the facts named in ``needs`` from a capture at the example sizes."""
    needs = tuple(needs)
    unknown = sorted(set(needs) - set(FACTS))
    if unknown:
        raise KeyError(f"unknown graph fact(s) {unknown}; known: {FACTS}")
    if not needs:
        return {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ftarget, finputs = fake_clone((target, tuple(example_inputs)), mode, dtype=dtype)
    cap = capture(ftarget, tuple(finputs), {}, frontend=frontend)
    dims = analyze_dims(cap.gm)
    time_cls, _ = infer_time_class(cap.gm, dims, time_axis)
    phs = list(cap.gm.graph.find_nodes(op="placeholder"))[cap.num_state:]
    batch_cls = None
    for p, b in zip(phs, axes.batch):
        if b:
            batch_cls = dims.canon(dims.input_labels[p.name][b[0]])
            break
    out: dict[str, sympy.Expr] = {}
    for name, fn in (("linear_attention_state_bytes", _linear_attention_state_bytes),
                     ("linear_attention_state_elements", _linear_attention_state_elements)):
        if name in needs:
            out[name] = fn(cap.gm, dims, time_cls, batch_cls, axes, regions, region_batch)
    return out
