"""Sizes a graph computes from the sequence length in Python, read from a symbolic trace.

The time facts of :mod:`gradshard.passes.respecialize` say how a dim moves with ``T`` when it
is ``T + c``, ``m * T`` or fixed. Sizes a model computes itself escape them: transformers'
Mamba-2 pads time to a multiple of its chunk, ``(c - T % c) % c`` steps, and splits the padded
axis into ``ceil(T / c)`` chunks; neither integer is a shift or a scale of ``T``.

A capture with the inputs' time (and batch) dims as symbols
(:func:`gradshard.capture.capture` with ``symbolic=``) keeps such sizes as expressions:
``pad(x, [0, 0, 0, Mod(-s0, 16)])``, ``reshape(.., [2, (s0 + Mod(-s0, 16)) // 16, 16, 8])``.
:func:`read_symbolic_sizes` aligns that trace with a kept concrete graph of the same model,
node by node (same op, same source line, in order), checks that every expression evaluated
at the kept graph's sizes gives the kept graph's integer and shape, and returns
:class:`SymbolicSizes`: per aligned node, which integer arguments are which expressions, and
time facts (``DimFact`` of kind ``"symbolic"``) for its output dims.
:func:`gradshard.passes.respecialize.respecialize` takes it and rewrites those integers by
evaluating the expressions at the new sizes.

Tracing assumed facts about the sizes (``Ne(chunks, 1)``, ``Mod(-T, 64) > 0``: the pad is not
empty); they are the record's guards, and a length that breaks one is refused
(:meth:`SymbolicSizes.failing_guard` names it and where tracing assumed it).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from gradshard.passes.respecialize import DimFact, RespecializeError

__all__ = ["BrokenGuard", "SymbolicSizes", "read_symbolic_sizes"]

#: How many candidates (same op and source line, in order) the alignment tries for a kept node.
_TRIES = 8


class BrokenGuard(RespecializeError):
    """The kept graph's own sizes break a guard of the symbolic trace (the two took different
    branches: a trace at other sizes may describe it)."""


@dataclass
class SymbolicSizes:
    """Integer arguments and output sizes of a kept graph's nodes as expressions in the
    length (``time``) and the batch (``batch``, None when the batch is static).

    ``args``: node name -> ((position in the flattened ``(args, kwargs)``, expression), ...).
    ``facts``: node name -> a ``DimFact`` per output dim (None for a dim no symbol reaches).
    ``guards``: (expression, where tracing assumed it), each true at ``hint``.
    ``hint``: the ``(T, B)`` the trace ran at."""

    args: dict[str, tuple[tuple[int, sympy.Expr], ...]]
    facts: dict[str, tuple[Optional[DimFact], ...]]
    guards: tuple[tuple[sympy.Expr, str], ...]
    time: sympy.Symbol
    batch: Optional[sympy.Symbol]
    hint: tuple[int, Optional[int]]
    _memo: dict[tuple, int] = field(default_factory=dict, repr=False)

    def value(self, expr: sympy.Expr, T: int, B: Optional[int]) -> int:
        """``expr`` at length ``T`` and batch ``B``."""
        key = (expr, T, B)
        if key not in self._memo:
            if len(self._memo) > 16384:  # a long run of new lengths: keep the memo bounded
                self._memo.clear()
            self._memo[key] = int(expr.xreplace(self._subs(T, B)))
        return self._memo[key]

    @property
    def symbols(self) -> set[sympy.Symbol]:
        return {self.time} | ({self.batch} if self.batch is not None else set())

    def _subs(self, T: int, B: Optional[int]) -> dict:
        subs = {self.time: sympy.Integer(T)}
        if self.batch is not None and B is not None:
            subs[self.batch] = sympy.Integer(B)
        return subs

    def failing_guard(self, T: int, B: Optional[int]) -> Optional[str]:
        """The first guard false at ``(T, B)``, as ``"<expression> (assumed at <where>)"`` with
        the symbols named ``T`` and ``B``; None when every guard holds."""
        subs = self._subs(T, B)
        for expr, where in self.guards:
            if not bool(expr.xreplace(subs)):
                return f"{self.readable(expr)} (assumed at {where})"
        return None

    def readable(self, expr: sympy.Expr) -> str:
        names = {self.time: sympy.Symbol("T", integer=True, positive=True)}
        if self.batch is not None:
            names[self.batch] = sympy.Symbol("B", integer=True, positive=True)
        return str(expr.xreplace(names))

    def rewrite_args(self, node: fx.Node, T: int, B: Optional[int]) -> Optional[tuple[tuple, dict]]:
        """``node``'s ``(args, kwargs)`` with its symbolic integers evaluated at ``(T, B)``; None
        for a node the trace does not cover."""
        if node.name not in self.args:
            return None
        leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        for pos, expr in self.args[node.name]:
            leaves[pos] = self.value(expr, T, B)
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return tuple(args), dict(kwargs)


def _expr(x: Any) -> Optional[sympy.Expr]:
    """The expression of a symbolic integer (a SymInt, or a node holding one), else None."""
    if isinstance(x, fx.Node):
        x = x.meta.get("val")
    return x.node.expr if isinstance(x, torch.SymInt) else None


def _is_sym_op(node: fx.Node) -> bool:
    """Nodes that compute integers (``sym_size``, ``operator.mod``): not in a concrete graph."""
    return (not isinstance(node.target, torch._ops.OpOverload)
            or isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)))


def _align(kept: fx.Graph, sym: fx.Graph, pairs: Callable[[fx.Node, fx.Node], bool]) -> dict[fx.Node, fx.Node]:
    """kept node -> its twin in the symbolic trace: the first op node after the previous twin
    with the same target and source line that ``pairs`` with it (the kept graph lacks what
    its passes removed: no-op casts, a folded mask subgraph; so the trace is searched per
    (target, source line), in order, not step by step)."""
    by_key: dict[tuple, list[tuple[int, fx.Node]]] = {}
    for pos, n in enumerate(n for n in sym.nodes if n.op == "call_function" and not _is_sym_op(n)):
        by_key.setdefault((n.target, n.meta.get("stack_trace")), []).append((pos, n))
    out: dict[fx.Node, fx.Node] = {}
    last = -1
    for node in kept.nodes:
        if node.op != "call_function":
            continue
        cands = by_key.get((node.target, node.meta.get("stack_trace")), [])
        first = bisect.bisect_right(cands, last, key=lambda c: c[0])
        for pos, twin in cands[first:first + _TRIES]:
            if pairs(node, twin):
                out[node] = twin
                last = pos
                break
    return out


def _shape_exprs(node: fx.Node) -> Optional[tuple[Any, ...]]:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def read_symbolic_sizes(kept: fx.GraphModule, sym: fx.GraphModule, sizes: tuple[int, Optional[int]],
                        time_inputs: Mapping[str, int], batch_inputs: Mapping[str, int],
                        hint: tuple[int, Optional[int]]) -> SymbolicSizes:
    """:class:`SymbolicSizes` for ``kept`` (captured at ``sizes``) from ``sym``, a symbolic
    trace of the same model at ``hint`` (``time_inputs``/``batch_inputs``: placeholder name ->
    the dim that is a symbol). Nodes pair up when their integers and shapes agree at ``sizes``
    (a node with no twin keeps its time facts). Raises :class:`RespecializeError` when the
    trace specialised an input's size, or the kept sizes break one of its guards."""
    phs = {ph.name: ph for ph in sym.graph.find_nodes(op="placeholder")}
    time = _input_symbol(phs, time_inputs, "length")
    batch = _input_symbol(phs, batch_inputs, "batch") if batch_inputs else None
    rec = SymbolicSizes({}, {}, (), time, batch, hint)
    T, B = sizes
    for ph in kept.graph.find_nodes(op="placeholder"):
        twin = phs.get(ph.name)
        facts = _facts(rec, ph, twin, T, B) if twin is not None else None
        if facts:
            rec.facts[ph.name] = facts

    def pairs(node: fx.Node, twin: fx.Node) -> bool:
        (k_leaves, k_spec), (s_leaves, s_spec) = (pytree.tree_flatten((n.args, n.kwargs)) for n in (node, twin))
        if k_spec != s_spec:
            return False
        args = _symbolic_args(rec, k_leaves, s_leaves, T, B)
        facts = _facts(rec, node, twin, T, B)
        if args is None or facts is False:
            return False
        rec.args[node.name] = args
        if facts is not None:
            rec.facts[node.name] = facts
        return True

    _align(kept.graph, sym.graph, pairs)
    rec.guards = _guards(sym, rec.symbols)
    why = rec.failing_guard(T, B)
    if why is not None:
        raise BrokenGuard(f"the graph kept at T={T} breaks the symbolic trace's guard {why}")
    return rec


def _symbolic_args(rec: SymbolicSizes, kept: list, sym: list, T: int,
                   B: Optional[int]) -> Optional[tuple[tuple[int, sympy.Expr], ...]]:
    """(position, expression) of each integer of a node's flattened arguments that the trace
    computed from the sizes; None when the two nodes' arguments do not pair up at the kept
    sizes (another number, a tensor against a number), or one is a float or a condition
    computed from the sizes (which no integer rewrite can follow)."""
    out = []
    for pos, (k, s) in enumerate(zip(kept, sym)):
        if isinstance(s, fx.Node) and isinstance(s.meta.get("val"), (torch.SymFloat, torch.SymBool)):
            return None
        expr = _expr(s)
        if expr is not None and expr.free_symbols:
            if not expr.free_symbols <= rec.symbols:
                return None
            if not isinstance(k, int) or isinstance(k, bool) or rec.value(expr, T, B) != k:
                return None
            out.append((pos, expr))
            continue
        if expr is not None:
            s = int(expr)
        if isinstance(k, fx.Node) != isinstance(s, fx.Node) or not isinstance(k, fx.Node) and k != s:
            return None
    return tuple(out)


def _input_symbol(phs: Mapping[str, fx.Node], dims: Mapping[str, int], what: str) -> sympy.Symbol:
    """The one symbol the inputs' ``dims`` are (each input's dim must be that plain symbol)."""
    found = set()
    for name, d in dims.items():
        shape = _shape_exprs(phs[name]) if name in phs else None
        expr = _expr(shape[d]) if shape is not None and d < len(shape) else None
        if expr is None or not isinstance(expr, sympy.Symbol):
            raise RespecializeError(f"the symbolic trace specialised the {what} of input `{name}` "
                                    f"(dim {d} is {shape[d] if shape else '?'})")
        found.add(expr)
    if len(found) != 1:
        raise RespecializeError(f"the inputs' {what} dims are {len(found)} different symbols in the symbolic trace")
    return found.pop()


def _facts(rec: SymbolicSizes, node: fx.Node, twin: fx.Node, T: int,
           B: Optional[int]) -> Optional[tuple[Optional[DimFact], ...]] | bool:
    """A ``"symbolic"`` fact per dim of ``twin``'s shape that a symbol reaches; None when the
    nodes are not tensors; False when the shapes differ at ``(T, B)``."""
    k_shape, s_shape = _shape_exprs(node), _shape_exprs(twin)
    if k_shape is None or s_shape is None:
        return None if k_shape is None and s_shape is None else False
    if len(k_shape) != len(s_shape):
        return False
    facts: list[Optional[DimFact]] = []
    for k, s in zip(k_shape, s_shape):
        expr = _expr(s)
        if expr is None or not expr.free_symbols:
            if int(k) != int(s):
                return False
            facts.append(None)
        elif not expr.free_symbols <= rec.symbols or rec.value(expr, T, B) != int(k):
            return False
        else:
            facts.append(DimFact("symbolic", 0, size_of=_SizeOf(rec, expr)))
    return tuple(facts)


@dataclass(frozen=True)
class _SizeOf:
    """A dim's size as a function of ``(T, B)`` (``DimFact.size_of`` of a ``"symbolic"`` fact)."""

    rec: SymbolicSizes = field(compare=False, hash=False)
    expr: sympy.Expr

    def __call__(self, T: int, B: Optional[int]) -> int:
        return self.rec.value(self.expr, T, B)


def _guards(sym: fx.GraphModule, symbols: set) -> tuple[tuple[sympy.Expr, str], ...]:
    """The shape environment's guards over ``symbols``, deduplicated, each with where tracing
    assumed it (the user's line when torch knows it), and the symbols' value ranges."""
    env = sym.meta["gs_shape_env"]
    out: dict[sympy.Expr, str] = {}
    for g in env.guards:
        expr = g.expr
        if not (expr.free_symbols & symbols) or expr in out:
            continue  # a guard on a size tracing made up alone (not an input's) does not bind T or B
        if not expr.free_symbols <= symbols:
            raise RespecializeError(f"the symbolic trace's guard {expr} ties the inputs' sizes to a size tracing "
                                    "made up, which a new length cannot be checked against")
        loc = g.sloc.maybe_user_loc or g.sloc.framework_loc
        out[expr] = loc if isinstance(loc, str) else f"{loc.filename}:{loc.lineno}" if loc is not None else "?"
    for s in symbols:
        vr = env.var_to_range.get(s)
        if vr is not None and vr.lower.is_finite:
            out.setdefault(sympy.Ge(s, int(vr.lower)), "the trace (a size of 0 or 1 is specialised)")
    return tuple(out.items())

