"""Dimension provenance, the core: label records, the rule context and the rule table.

:class:`NodeDims` holds the labels of each output dimension of one node,
:class:`DimAnalysis` the labels of a whole graph (with a union-find of the labels that are
one axis), :class:`DimsContext` what a rule may do (read an argument's labels, make fresh
labels, unify dims), and :data:`DIM_RULES` maps an op (aten ``OpOverloadPacket``, a custom
op, or a callable like ``operator.getitem``) to its rule, filled by
:func:`register_dim_rule`. The shared helpers that several rules use (broadcasting,
pointwise ops) live here too. The aten rules are in :mod:`.dim_rules_layout` and
:mod:`.dim_rules_compute`; the analysis that applies them is :mod:`.dims`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import networkx as nx
import torch
import torch.fx as fx

aten = torch.ops.aten

__all__ = [
    "Labels", "Factors", "NodeDims", "SplitRecord", "DimAnalysis", "DimsContext", "Rule", "DIM_RULES",
    "register_dim_rule",
    "shape_of", "norm_dim", "merge_selected", "broadcast_dims", "tensor_args", "pointwise_rule", "carry_factors",
    "iota_length",
]

Labels = tuple[frozenset[int], ...]
Factors = tuple[tuple[frozenset[int], int], ...]  # a merged dim's (labels, size) factors, in order


@dataclass(frozen=True)
class NodeDims:
    """Labels per output dimension; ``selected`` = labels a ``select`` removed (loop steps)."""

    dims: Labels
    selected: frozenset[int] = frozenset()
    index: int | None = None  # for select nodes: the step index read
    # per dim, the (labels, size) factors a merged dim is made of (None: one factor per dim)
    factors: tuple[Factors, ...] | None = None


@dataclass(frozen=True)
class SplitRecord:
    """A dim with labels ``whole`` split by a reshape into pieces with fresh labels.

    ``pieces`` are the (label, size) of the pieces in order (a time axis split into
    ``(T/c, c)`` blocks gives two). A later reshape that merges exactly these pieces, in this
    order, gives the merged dim the labels ``whole`` again.
    """

    whole: frozenset[int]
    pieces: tuple[tuple[int, int], ...]


@dataclass
class DimAnalysis:
    """Result of :func:`analyze_dims` (an analysis: the graph is not changed)."""

    nodes: dict[str, NodeDims | tuple[NodeDims | None, ...]]
    classes: nx.utils.UnionFind
    input_labels: dict[str, tuple[int, ...]]  # placeholder name -> label per dim
    opaque: list[str] = field(default_factory=list)
    splits: list[SplitRecord] = field(default_factory=list)  # splits that gave pieces fresh labels

    def canon(self, label: int) -> int:
        return self.classes[label]

    def dims_of(self, node: fx.Node | str) -> NodeDims | None:
        name = node if isinstance(node, str) else node.name
        d = self.nodes.get(name)
        return d if isinstance(d, NodeDims) else None

    def axes_in_class(self, node: fx.Node | str, cls: int) -> tuple[int, ...]:
        """Output dims of ``node`` whose labels belong to equivalence class ``cls``."""
        d = self.dims_of(node)
        if d is None:
            return ()
        return tuple(i for i, ls in enumerate(d.dims) if any(self.canon(l) == cls for l in ls))


def shape_of(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    return None


# --------------------------------------------------------------------------- rule context


class DimsContext:
    def __init__(self, analysis: DimAnalysis, counter: list[int]):
        self.a = analysis
        self.counter = counter

    def fresh(self) -> int:
        self.counter[0] += 1
        lab = self.counter[0]
        self.a.classes[lab]  # register
        return lab

    def fresh_dims(self, shape: Iterable[int]) -> Labels:
        return tuple(frozenset([self.fresh()]) if s != 1 else frozenset() for s in shape)

    def get(self, arg: Any) -> NodeDims | None:
        if isinstance(arg, fx.Node):
            d = self.a.nodes.get(arg.name)
            return d if isinstance(d, NodeDims) else None
        return None

    def dims(self, arg: Any) -> Labels:
        d = self.get(arg)
        if d is not None:
            return d.dims
        shp = shape_of(arg) if isinstance(arg, fx.Node) else None
        return tuple(frozenset() for _ in shp) if shp else ()

    def factors(self, arg: Any, i: int) -> "Factors | None":
        """The (labels, size) factors of dim ``i`` of ``arg`` when it is a merged dim, else None."""
        d = self.get(arg)
        if d is None or d.factors is None or i >= len(d.factors):
            return None
        return d.factors[i] or None

    def union(self, labels: Iterable[int]) -> None:
        labels = list(labels)
        if len(labels) > 1:
            self.a.classes.union(*labels)

    def unify(self, sides: list[tuple[frozenset[int], "Factors | None"]]) -> None:
        """Declare the dims in ``sides`` (one per operand) to be the same axis.

        Single-label dims unify directly; merged dims (``B*T``) unify factor by factor when
        their factor sizes line up, and are otherwise left apart (never merge B with T).
        """
        sides = [(ls, fs) for ls, fs in sides if ls]
        if len(sides) < 2:
            return
        classes = [{self.a.classes[l] for l in ls} for ls, _ in sides]
        if all(len(c) == 1 for c in classes):
            self.union(next(iter(c)) for c in classes)
            return
        facs = [fs for _, fs in sides]
        if all(fs is not None for fs in facs) and len({tuple(sz for _, sz in fs) for fs in facs}) == 1:
            for parts in zip(*facs):
                self.union(l for ls, _ in parts for l in ls)


Rule = Callable[[fx.Node, DimsContext], "NodeDims | tuple[NodeDims | None, ...] | None"]
DIM_RULES: dict[Any, Rule] = {}


def register_dim_rule(*ops: Any) -> Callable[[Rule], Rule]:
    """Register a dimension rule for aten op packets (or callables like ``operator.getitem``)."""

    def deco(fn: Rule) -> Rule:
        for op in ops:
            DIM_RULES[op] = fn
        return fn

    return deco


def norm_dim(d: int, nd: int) -> int:
    """``d`` as a non-negative dim of a rank-``nd`` tensor."""
    return d + nd if d < 0 else d


def carry_factors(src: NodeDims | None, src_shape: tuple[int, ...], dims: Labels, out_shape: tuple[int, ...],
                  source: Iterable[int | None]) -> tuple[Factors, ...] | None:
    """Factors of an output whose dim ``i`` is dim ``source[i]`` of ``src`` (None: a dim of its own).

    A carried dim of unchanged size keeps the factors of its source dim (a merged ``B*T`` stays
    splittable); any other dim is one factor of its own labels. None when ``src`` has none.
    """
    if src is None or src.factors is None:
        return None
    out: list[Factors] = []
    for i, j in enumerate(source):
        size = out_shape[i] if i < len(out_shape) else 1
        if (j is not None and j < len(src.factors) and j < len(src_shape) and src_shape[j] == size
                and src.factors[j]):
            out.append(src.factors[j])
        else:
            out.append(((dims[i], size),) if i < len(dims) and dims[i] and size != 1 else ())
    return tuple(out)


def merge_selected(node: fx.Node, ctx: DimsContext) -> frozenset[int]:
    """The loop-step labels (``NodeDims.selected``) of all of ``node``'s inputs."""
    out: set[int] = set()
    for a in node.all_input_nodes:
        d = ctx.get(a)
        if d is not None:
            out |= d.selected
    return frozenset(out)


# --------------------------------------------------------------------------- broadcast / pointwise


def broadcast_dims(node: fx.Node, ctx: DimsContext, args: Iterable[Any]) -> NodeDims:
    """Right-align every tensor arg with the output; equal non-1 sizes unify labels."""
    out_shape = shape_of(node) or ()
    nd = len(out_shape)
    acc: list[set[int]] = [set() for _ in range(nd)]
    sides: list[list[tuple[frozenset[int], Any]]] = [[] for _ in range(nd)]
    for a in args:
        shp = shape_of(a) if isinstance(a, fx.Node) else None
        if shp is None:
            continue
        dims = ctx.dims(a)
        d = ctx.get(a)
        off = nd - len(shp)
        for i, (s, ls) in enumerate(zip(shp, dims)):
            j = i + off
            if 0 <= j < nd and s == out_shape[j] and s != 1:
                acc[j] |= ls
                sides[j].append((ls, d.factors[i] if d is not None and d.factors is not None else None))
    for sd in sides:
        ctx.unify(sd)
    factors = None
    for a in args:
        d = ctx.get(a)
        if d is not None and d.factors is not None and shape_of(a) == tuple(out_shape):
            factors = d.factors
            break
    return NodeDims(tuple(frozenset(s) for s in acc), merge_selected(node, ctx), factors=factors)


def tensor_args(node: fx.Node) -> list[Any]:
    """The node arguments of ``node`` (lists flattened, kwargs included)."""
    flat: list[Any] = []
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, (list, tuple)):
            flat.extend(x for x in a if isinstance(x, fx.Node))
        elif isinstance(a, fx.Node):
            flat.append(a)
    return flat


def pointwise_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    """Elementwise ops: every tensor argument broadcast against the output."""
    return broadcast_dims(node, ctx, tensor_args(node))


# --------------------------------------------------------------------------- index values

#: Ops an ``arange`` index passes through unchanged in value order (views, casts, ``+ 0``).
_IOTA_PASS = {aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default,
              aten._to_copy.default, aten.to.dtype, aten.to.device, aten.clone.default, aten.alias.default}


def iota_length(n: Any) -> int | None:
    """``n`` for an index that is ``arange(n)`` (start 0, step 1) seen through views, casts
    and ``+ 0``; else None."""
    while isinstance(n, fx.Node):
        args = n.args
        if n.target is aten.arange.default:
            return args[0] if isinstance(args[0], int) else None
        if n.target in (aten.arange.start, aten.arange.start_step):
            step = args[2] if len(args) > 2 else 1
            return args[1] if args[0] == 0 and step == 1 and isinstance(args[1], int) else None
        if n.target is aten.add.Tensor and len(args) > 1 and not isinstance(args[1], fx.Node) and args[1] == 0:
            n = args[0]
        elif n.target in _IOTA_PASS:
            n = args[0]
        else:
            return None
    return None
