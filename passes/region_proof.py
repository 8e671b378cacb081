"""Values and subgraphs for the numeric proofs of recognised regions.

A recogniser (``recurrence_lightning``, ``recurrence_delta``) finds a candidate region by
structure, then *proves* it: it runs the region on random inputs, with its grad-free constants
(decay tables, masks) computed from the example parameters and buffers, and compares with a
reference recurrence. This module holds what those proofs share: which nodes are grad-free
constants, their values, the region cut out as a callable, and the tolerance the constants'
precision allows.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
import torch.fx as fx

from gradshard.autocast import AutocastState
from gradshard.ir import graph_module, is_call_input

aten = torch.ops.aten

__all__ = ["MAX_EVAL_ELEMENTS", "constant_value", "exact_arithmetic", "grad_free_constant", "is_data",
           "proof_tolerance", "region_subgraph", "to_f64", "widen_float_dtypes"]

#: Constants larger than this are not evaluated (the proof is skipped, the region not claimed).
MAX_EVAL_ELEMENTS = 1 << 24

_SHAPE_ONLY = {aten.new_zeros, aten.new_ones, aten.new_full, aten.zeros_like, aten.ones_like, aten.full_like}


def is_data(ph: fx.Node) -> bool:
    """A placeholder that is a call input (not a parameter or buffer)."""
    return is_call_input(ph)


def _shape_only(node: fx.Node) -> bool:
    """A deterministic op that reads only its inputs' metadata (``new_zeros(q, ...)``)."""
    return node.op == "call_function" and getattr(node.target, "_overloadpacket", None) in _SHAPE_ONLY


def _constant_ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and what its value depends on (not the inputs of shape-only ops), in graph order."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if not _shape_only(n):
            stack.extend(n.all_input_nodes)
    index = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=index.__getitem__)


def grad_free_constant(node: fx.Node, values: dict[str, Any]) -> bool:
    """``node``'s value depends on no call input and on no parameter that requires grad."""
    for a in _constant_ancestors(node):
        if a.op == "placeholder":
            val = values.get(a.name)
            if is_data(a) or not isinstance(val, torch.Tensor) or val.requires_grad:
                return False
        elif a.op not in ("call_function", "get_attr"):
            return False
    return True


def constant_value(node: fx.Node, known: dict[str, torch.Tensor],
                    memo: dict[fx.Node, Any]) -> Optional[torch.Tensor]:
    """The value of a grad-free constant node from the example parameters and buffers (None if
    it cannot be computed); shape-only ops run on zeros of their inputs' shapes."""
    gm = node.graph.owning_module
    try:
        for n in _constant_ancestors(node):
            if n in memo:
                continue
            if n.op == "placeholder":
                memo[n] = known[n.name].detach()
            elif n.op == "get_attr":
                memo[n] = operator.attrgetter(n.target)(gm)
            else:
                val = n.meta.get("val")
                if isinstance(val, torch.Tensor) and val.numel() > MAX_EVAL_ELEMENTS:
                    return None
                read = (lambda a: torch.zeros(a.meta["val"].shape, dtype=a.meta["val"].dtype)) \
                    if _shape_only(n) else memo.__getitem__
                with torch.no_grad():
                    memo[n] = n.target(*fx.node.map_arg(n.args, read), **fx.node.map_arg(n.kwargs, read))
    except Exception:  # noqa: BLE001 - a value we cannot compute is no constant
        return None
    out = memo.get(node)
    return out if isinstance(out, torch.Tensor) else None


def region_subgraph(gm: fx.GraphModule, inputs: Iterable[fx.Node], nodes: Iterable[fx.Node] | frozenset[fx.Node],
                    output: fx.Node | Sequence[fx.Node], *, widen: bool = True) -> fx.GraphModule:
    """``nodes`` of ``gm`` (in graph order; an input among them stays an input) as a callable of
    ``inputs`` returning ``output`` (a tuple for a sequence of nodes); computing in float64
    (:func:`widen_float_dtypes`) unless ``widen`` is False (at the captured dtypes)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = g.placeholder(f"in{i}")
    members = set(nodes)
    for n in gm.graph.nodes:
        if n in members and n not in env:
            env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[output] if isinstance(output, fx.Node) else tuple(env[o] for o in output))
    if widen:
        widen_float_dtypes(g)
    return graph_module(gm, g)


def _widen(arg: Any) -> Any:
    return torch.float64 if isinstance(arg, torch.dtype) and arg.is_floating_point else arg


def widen_float_dtypes(graph: fx.Graph) -> None:
    """Make every floating dtype a node of ``graph`` names float64 (in place).

    A proof graph then computes in float64 throughout: the casts ``torch.autocast`` records
    around matmuls (``_to_copy(x, dtype=bfloat16)``), a model's own ``.float()`` / ``.to(half)``,
    a factory's ``dtype=``. A cast only rounds, so the region computes the same function without
    them, and the proof compares that function with the reference recurrence at float64
    precision instead of at the precision of the region's lowest cast."""
    for n in graph.nodes:
        if n.op == "call_function":
            n.args, n.kwargs = fx.node.map_aggregate(n.args, _widen), fx.node.map_aggregate(n.kwargs, _widen)


@contextlib.contextmanager
def exact_arithmetic() -> Iterator[None]:
    """Where a proof runs its region: no autograd and no autocast (a compile runs at the first call,
    which may sit inside the user's ``torch.autocast`` block: its matmuls would run in bfloat16)."""
    with torch.no_grad(), AutocastState.off().restore():
        yield


def to_f64(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float64 when it is floating point."""
    return x.to(torch.float64) if x.is_floating_point() else x


def proof_tolerance(consts: Iterable[torch.Tensor]) -> Optional[float]:
    """Relative tolerance of the proof: the precision of the region's constants.

    Decay tables computed in float32 and stored in a float64 model (transformers builds
    buffers before casting) differ from exact powers of ``λ`` by float32 rounding: the
    proof then accepts ``100 eps(float32)``; float64 constants get 1e-9. None (no proof)
    when constants only hold half precision, too coarse to tell decays apart.
    """
    eps = torch.finfo(torch.float64).eps
    for c in consts:
        if not c.is_floating_point() or c.numel() == 0:
            continue
        x = c.detach().to(torch.float64)
        if bool((x == x.round()).all()):
            continue  # integers (zeros, ones, 0/1 masks) are exact in any precision
        for low in (torch.float16, torch.bfloat16, torch.float32):
            if torch.finfo(low).eps > eps and torch.equal(x.to(low).to(torch.float64), x):
                eps = torch.finfo(low).eps
                break
    if eps > torch.finfo(torch.float32).eps:
        return None
    return 1e-9 if eps == torch.finfo(torch.float64).eps else 100 * eps
