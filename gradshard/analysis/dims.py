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
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import networkx as nx
import torch
import torch.fx as fx

aten = torch.ops.aten

__all__ = ["NodeDims", "DimAnalysis", "analyze_dims", "DIM_RULES", "register_dim_rule", "shape_of"]

Labels = tuple[frozenset[int], ...]


@dataclass(frozen=True)
class NodeDims:
    """Labels per output dimension; ``selected`` = labels a ``select`` removed (loop steps)."""

    dims: Labels
    selected: frozenset[int] = frozenset()
    index: int | None = None  # for select nodes: the step index read
    # per dim, the (labels, size) factors a merged dim is made of (None: one factor per dim)
    factors: tuple[tuple[tuple[frozenset[int], int], ...], ...] | None = None


@dataclass
class DimAnalysis:
    """Result of :func:`analyze_dims` (an analysis: the graph is not changed)."""

    nodes: dict[str, NodeDims | tuple[NodeDims | None, ...]]
    classes: nx.utils.UnionFind
    input_labels: dict[str, tuple[int, ...]]  # placeholder name -> label per dim
    opaque: list[str] = field(default_factory=list)

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


class _Ctx:
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


Rule = Callable[[fx.Node, _Ctx], "NodeDims | tuple[NodeDims | None, ...] | None"]
DIM_RULES: dict[Any, Rule] = {}


def register_dim_rule(*ops: Any) -> Callable[[Rule], Rule]:
    """Register a dimension rule for aten op packets (or callables like ``operator.getitem``)."""

    def deco(fn: Rule) -> Rule:
        for op in ops:
            DIM_RULES[op] = fn
        return fn

    return deco


def _norm(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


def _merge_selected(node: fx.Node, ctx: _Ctx) -> frozenset[int]:
    out: set[int] = set()
    for a in node.all_input_nodes:
        d = ctx.get(a)
        if d is not None:
            out |= d.selected
    return frozenset(out)


# --------------------------------------------------------------------------- broadcast / pointwise


def broadcast_dims(node: fx.Node, ctx: _Ctx, args: Iterable[Any]) -> NodeDims:
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
    return NodeDims(tuple(frozenset(s) for s in acc), _merge_selected(node, ctx), factors=factors)


def _tensor_args(node: fx.Node) -> list[Any]:
    flat: list[Any] = []
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, (list, tuple)):
            flat.extend(x for x in a if isinstance(x, fx.Node))
        elif isinstance(a, fx.Node):
            flat.append(a)
    return flat


def pointwise_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    return broadcast_dims(node, ctx, _tensor_args(node))


_SAME_SHAPE_OPS = [
    aten.clone, aten.contiguous, aten.detach, aten.alias, aten._to_copy, aten.to, aten.type_as,
    aten.dropout, aten.native_dropout, aten.masked_fill, aten.where, aten.fill, aten.zeros_like,
    aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like,
    aten.silu, aten.gelu, aten.relu, aten.softplus, aten.sigmoid, aten.tanh, aten.clamp,
    aten.lift_fresh_copy, aten.copy, aten.expand, aten.expand_as, aten.broadcast_to,
    aten.masked_fill_, aten.copy_, aten.dropout_, aten.feature_dropout, aten.hardtanh,
    aten.leaky_relu, aten.elu, aten.mish, aten.logit, aten.nan_to_num, aten.pow, aten.lerp,
    aten.addcmul, aten.addcdiv, aten.clamp_min, aten.clamp_max, aten.bitwise_not,
    aten.logical_not, aten.logical_and, aten.logical_or, aten.eq, aten.ne, aten.lt, aten.le,
    aten.gt, aten.ge, aten.minimum, aten.maximum, aten.log_sigmoid, aten.hardswish,
    aten.hardsigmoid, aten.relu6, aten.softshrink, aten.hardshrink, aten.selu, aten.celu,
    aten.square, aten.bernoulli,
]
register_dim_rule(*_SAME_SHAPE_OPS)(pointwise_rule)


@register_dim_rule(aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full)
def _new_tensor_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    """``x.new_zeros(shape)`` reads only x's dtype/device: fresh labels, nothing inherited."""
    return NodeDims(ctx.fresh_dims(shape_of(node) or ()))


# --------------------------------------------------------------------------- views


Factors = tuple[tuple[frozenset[int], int], ...]


def reshape_labels(in_shape: tuple[int, ...], out_shape: tuple[int, ...], labels: Labels,
                   factors: tuple[Factors, ...] | None = None) -> tuple[Labels, tuple[Factors, ...]]:
    """Map labels through a reshape by grouping dims whose size products agree.

    A merged dim remembers its factors, so ``(B, T) -> (B*T,) -> (B, T)`` gives time back
    to the second dim only; a split whose boundaries do not fall on factors gives every
    resulting dim the union of the group's labels.
    """
    if factors is None:
        factors = tuple(((ls, s),) if s != 1 else () for ls, s in zip(labels, in_shape))
    out: list[frozenset[int]] = [frozenset() for _ in out_shape]
    out_f: list[Factors] = [() for _ in out_shape]
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(in_shape):
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            elif j < len(out_shape):
                pj *= out_shape[j]
                gj.append(j)
                j += 1
            else:
                break
        flat = [f for k in gi for f in factors[k]]
        assigned = _assign_factors(flat, [out_shape[k] for k in gj])
        if assigned is None:
            group = frozenset().union(*(labels[k] for k in gi if in_shape[k] != 1))
            for k in gj:
                if out_shape[k] != 1:
                    out[k], out_f[k] = group, ((group, out_shape[k]),)
        else:
            for k, fs in zip(gj, assigned):
                out[k] = frozenset().union(*(ls for ls, _ in fs)) if fs else frozenset()
                out_f[k] = fs
    return tuple(out), tuple(out_f)


def _assign_factors(flat: list[tuple[frozenset[int], int]], sizes: list[int]) -> list[Factors] | None:
    """Split a factor list into consecutive runs whose products are ``sizes`` (or None)."""
    res: list[Factors] = []
    f = 0
    for size in sizes:
        run: list[tuple[frozenset[int], int]] = []
        prod = 1
        while prod < size and f < len(flat):
            run.append(flat[f])
            prod *= flat[f][1]
            f += 1
        if prod != size:
            return None
        res.append(tuple(run))
    return res if f == len(flat) else None


@register_dim_rule(aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten,
                   aten.squeeze, aten.unsqueeze, aten.view_as, aten.reshape_as)
def _reshape_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    src = node.args[0]
    in_shape, out_shape = shape_of(src) or (), shape_of(node) or ()
    d = ctx.get(src)
    labels = d.dims if d else ctx.fresh_dims(in_shape)
    dims, factors = reshape_labels(in_shape, out_shape, labels, d.factors if d else None)
    return NodeDims(dims, d.selected if d else frozenset(), factors=factors)


@register_dim_rule(aten.transpose, aten.swapaxes, aten.swapdims)
def _transpose_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    d = ctx.get(node.args[0])
    dims = list(d.dims if d else ctx.fresh_dims(shape_of(node.args[0]) or ()))
    a, b = _norm(node.args[1], len(dims)), _norm(node.args[2], len(dims))
    dims[a], dims[b] = dims[b], dims[a]
    factors = list(d.factors) if d is not None and d.factors is not None else None
    if factors is not None:
        factors[a], factors[b] = factors[b], factors[a]
    return NodeDims(tuple(dims), d.selected if d else frozenset(), factors=tuple(factors) if factors else None)


@register_dim_rule(aten.t)
def _t_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    dims = ctx.dims(node.args[0])
    return NodeDims(tuple(reversed(dims)), _merge_selected(node, ctx))


@register_dim_rule(aten.permute)
def _permute_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    d = ctx.get(node.args[0])
    dims = ctx.dims(node.args[0])
    perm = [_norm(p, len(dims)) for p in node.args[1]]
    factors = tuple(d.factors[p] for p in perm) if d is not None and d.factors is not None else None
    return NodeDims(tuple(dims[p] for p in perm), _merge_selected(node, ctx), factors=factors)


@register_dim_rule(aten.movedim)
def _movedim_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    dims = list(ctx.dims(node.args[0]))
    src, dst = node.args[1], node.args[2]
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    nd = len(dims)
    src = [_norm(s, nd) for s in src]
    dst = [_norm(s, nd) for s in dst]
    order = [i for i in range(nd) if i not in src]
    out: list[Any] = [None] * nd
    for s, t in zip(src, dst):
        out[t] = dims[s]
    it = iter(order)
    for i in range(nd):
        if out[i] is None:
            out[i] = dims[next(it)]
    return NodeDims(tuple(out), _merge_selected(node, ctx))


@register_dim_rule(aten.repeat)
def _repeat_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    dims = ctx.dims(node.args[0])
    reps = list(node.args[1])
    pad = len(reps) - len(dims)
    full = (frozenset(),) * pad + tuple(dims)
    out = tuple(ls if r == 1 else frozenset() for ls, r in zip(full, reps))
    return NodeDims(out, _merge_selected(node, ctx))


@register_dim_rule(aten.repeat_interleave)
def _repeat_interleave_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    src = node.args[0]
    if not isinstance(src, fx.Node) or shape_of(src) is None:
        return NodeDims(ctx.fresh_dims(shape_of(node) or ()))
    dims = list(ctx.dims(src))
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
    if dim is None:
        return NodeDims(ctx.fresh_dims(shape_of(node) or ()))
    dims[_norm(dim, len(dims))] = frozenset()  # heads repeated: a new (non-time) axis
    return NodeDims(tuple(dims), _merge_selected(node, ctx))


# --------------------------------------------------------------------------- indexing


@register_dim_rule(aten.select)
def _select_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    d = ctx.get(node.args[0])
    dims = list(d.dims if d else ctx.fresh_dims(shape_of(node.args[0]) or ()))
    dim = _norm(node.args[1], len(dims))
    removed = dims.pop(dim)
    sel = (d.selected if d else frozenset()) | removed
    return NodeDims(tuple(dims), sel, index=int(node.args[2]))


@register_dim_rule(aten.slice, aten.narrow, aten.index_select, aten.constant_pad_nd, aten.pad,
                   aten.roll, aten.flip, aten.gather, aten.scatter, aten.index_add, aten.index_copy)
def _same_rank_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    """Rank-preserving indexing: each output dim keeps its input labels (sizes may change)."""
    return NodeDims(ctx.dims(node.args[0]), _merge_selected(node, ctx))


@register_dim_rule(aten.index)
def _index_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    src, idx = node.args[0], node.args[1]
    dims = list(ctx.dims(src))
    out_shape = shape_of(node) or ()
    idx_nodes = [i for i in idx if i is not None]
    if len(idx_nodes) == 1 and all(i is None for i in idx[: idx.index(idx_nodes[0])]):
        k = idx.index(idx_nodes[0])
        idx_dims = ctx.dims(idx_nodes[0]) if isinstance(idx_nodes[0], fx.Node) else ()
        out = tuple(dims[:k]) + tuple(idx_dims) + tuple(dims[k + 1 :])
        if len(out) == len(out_shape):
            return NodeDims(out, _merge_selected(node, ctx))
    return NodeDims(ctx.fresh_dims(out_shape))


@register_dim_rule(aten.embedding)
def _embedding_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    weight, idx = node.args[0], node.args[1]
    return NodeDims(tuple(ctx.dims(idx)) + (ctx.dims(weight)[-1],), _merge_selected(node, ctx))


@register_dim_rule(aten.cat, aten.concat, aten.concatenate)
def _cat_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    pieces = [p for p in node.args[0] if isinstance(p, fx.Node)]
    out_shape = shape_of(node) or ()
    dim = _norm(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(out_shape))
    acc: list[set[int]] = [set() for _ in out_shape]
    along: set[int] = set()
    sides: list[list[frozenset[int]]] = [[] for _ in out_shape]
    for p in pieces:
        pd = ctx.get(p)
        shp = shape_of(p) or ()
        if pd is None or len(shp) != len(out_shape):
            continue
        for i, ls in enumerate(pd.dims):
            if i == dim:
                along |= ls
                if shp[i] == 1:  # unsqueezed loop step: the new axis is the selected one
                    along |= pd.selected
            elif shp[i] == out_shape[i] and shp[i] != 1:
                acc[i] |= ls
                sides[i].append(ls)
    acc[dim] |= along
    for sd in sides:
        ctx.unify([(ls, None) for ls in sd])
    return NodeDims(tuple(frozenset(s) for s in acc), frozenset())


@register_dim_rule(aten.stack)
def _stack_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    pieces = [p for p in node.args[0] if isinstance(p, fx.Node)]
    out_shape = shape_of(node) or ()
    dim = _norm(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(out_shape))
    nd = len(out_shape) - 1
    acc: list[set[int]] = [set() for _ in range(nd)]
    new_axis: set[int] = set()
    sides: list[list[frozenset[int]]] = [[] for _ in range(nd)]
    for p in pieces:
        pd = ctx.get(p)
        if pd is None:
            continue
        new_axis |= pd.selected
        for i, ls in enumerate(pd.dims[:nd]):
            acc[i] |= ls
            sides[i].append(ls)
    for sd in sides:
        ctx.unify([(ls, None) for ls in sd])
    ctx.union(new_axis)
    dims = [frozenset(s) for s in acc]
    dims.insert(dim, frozenset(new_axis) if len(pieces) > 1 else frozenset())
    return NodeDims(tuple(dims), frozenset())


@register_dim_rule(aten.unbind, aten.split, aten.split_with_sizes, aten.chunk, aten.tensor_split)
def _split_rule(node: fx.Node, ctx: _Ctx) -> tuple[NodeDims | None, ...]:
    d = ctx.get(node.args[0])
    vals = node.meta.get("val") or ()
    dims = d.dims if d else ()
    if node.target is aten.unbind.int:
        dim = _norm(node.args[1] if len(node.args) > 1 else 0, len(dims))
        rest = tuple(x for i, x in enumerate(dims) if i != dim)
        return tuple(NodeDims(rest, (d.selected if d else frozenset()) | dims[dim], index=i) for i in range(len(vals)))
    return tuple(NodeDims(dims, d.selected if d else frozenset()) for _ in vals)


@register_dim_rule(operator.getitem)
def _getitem_rule(node: fx.Node, ctx: _Ctx) -> NodeDims | None:
    src = ctx.a.nodes.get(node.args[0].name) if isinstance(node.args[0], fx.Node) else None
    if isinstance(src, tuple) and isinstance(node.args[1], int) and node.args[1] < len(src):
        return src[node.args[1]]
    return None


# --------------------------------------------------------------------------- contractions


def _matmul_dims(a: Labels, b: Labels, sa: tuple[int, ...], sb: tuple[int, ...],
                 out_shape: tuple[int, ...], ctx: _Ctx) -> Labels:
    vec_a, vec_b = len(sa) == 1, len(sb) == 1  # torch.matmul drops a vector operand's dim
    if vec_a:
        a, sa = (frozenset(),) + a, (1,) + sa
    if vec_b:
        b, sb = b + (frozenset(),), sb + (1,)
    batch_nd = max(len(sa), len(sb)) - 2
    full_shape = tuple(out_shape[:batch_nd]) + (sa[-2], sb[-1])
    out: list[set[int]] = [set() for _ in range(batch_nd)]
    sides: list[list[frozenset[int]]] = [[] for _ in range(batch_nd)]
    for labels, shp in ((a[:-2], sa[:-2]), (b[:-2], sb[:-2])):
        off = batch_nd - len(shp)
        for i, (ls, s) in enumerate(zip(labels, shp)):
            if 0 <= i + off < batch_nd and s == full_shape[i + off] and s != 1:
                out[i + off] |= ls
                sides[i + off].append(ls)
    for sd in sides:
        ctx.unify([(ls, None) for ls in sd])
    ctx.unify([(a[-1], None), (b[-2], None)])  # contracted dims are the same axis
    res = [frozenset(s) for s in out] + ([] if vec_a else [a[-2]]) + ([] if vec_b else [b[-1]])
    return tuple(res)


def _carry_leading_factors(src: NodeDims | None, n_lead: int, last: frozenset[int], last_size: int):
    """Factors of an ``x @ W`` output: x's leading dims keep theirs (a merged ``B*T`` row dim
    stays splittable), the new last dim is one factor."""
    if src is None or src.factors is None:
        return None
    return tuple(src.factors[:n_lead]) + (((last, last_size),) if last and last_size != 1 else (),)


def _matmul_factors(a: Any, b: Any, out_shape: tuple[int, ...], dims: Labels,
                    ctx: _Ctx) -> tuple[Factors, ...] | None:
    """Factors of a matmul output: batch dims from the operand aligned with them (so a merged
    ``B*T`` batch of a ``bmm`` stays splittable), rows from ``a``, columns from ``b``."""
    sa, sb = shape_of(a) or (), shape_of(b) or ()
    ad, bd = ctx.get(a), ctx.get(b)
    if len(out_shape) < 2 or len(sa) < 2 or len(sb) < 2 or not ((ad and ad.factors) or (bd and bd.factors)):
        return None

    def own(d: NodeDims | None, shp: tuple[int, ...], i: int) -> Factors | None:
        """Factors of dim ``i`` of an operand (a plain dim is its own single factor)."""
        if d is None or not (0 <= i < len(shp)) or shp[i] == 1:
            return None
        if d.factors is not None and i < len(d.factors) and d.factors[i]:
            return d.factors[i]
        return ((d.dims[i], shp[i]),) if d.dims[i] else None

    out: list[Factors] = []
    nb = len(out_shape) - 2
    for i in range(nb):
        fs: Factors | None = None
        for d, shp in ((ad, sa), (bd, sb)):
            j = i - (nb - (len(shp) - 2))
            if fs is None and 0 <= j < len(shp) - 2 and shp[j] == out_shape[i]:
                fs = own(d, shp, j)
        out.append(fs or (((dims[i], out_shape[i]),) if dims[i] and out_shape[i] != 1 else ()))
    row = own(ad, sa, len(sa) - 2)
    out.append(row or (((dims[-2], out_shape[-2]),) if dims[-2] and out_shape[-2] != 1 else ()))
    out.append(((dims[-1], out_shape[-1]),) if dims[-1] and out_shape[-1] != 1 else ())
    return tuple(out)


@register_dim_rule(aten.matmul, aten.bmm, aten.mm)
def _matmul_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    a, b = node.args[0], node.args[1]
    out_shape = shape_of(node) or ()
    dims = _matmul_dims(ctx.dims(a), ctx.dims(b), shape_of(a) or (), shape_of(b) or (), out_shape, ctx)
    return NodeDims(dims, _merge_selected(node, ctx), factors=_matmul_factors(a, b, out_shape, dims, ctx))


@register_dim_rule(aten.baddbmm, aten.addmm, aten.addbmm)
def _addmm_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    bias, a, b = node.args[0], node.args[1], node.args[2]
    mm = _matmul_dims(ctx.dims(a), ctx.dims(b), shape_of(a) or (), shape_of(b) or (), shape_of(node) or (), ctx)
    bd = broadcast_dims(node, ctx, [bias])
    dims = tuple(x | y for x, y in zip(mm, bd.dims))
    ad = ctx.get(a)
    factors = None
    if ad is not None and ad.factors is not None and len(shape_of(a) or ()) == 2 and len(dims) == 2:
        factors = (ad.factors[0], ((dims[1], (shape_of(node) or (0, 0))[1]),) if dims[1] else ())
    return NodeDims(dims, _merge_selected(node, ctx), factors=factors)


@register_dim_rule(aten.linear)
def _linear_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    x, w = node.args[0], node.args[1]
    xd = ctx.dims(x)
    wd = ctx.dims(w)
    if len(wd) == 2:
        ctx.unify([(xd[-1], None), (wd[1], None)])
        return NodeDims(tuple(xd[:-1]) + (wd[0],), _merge_selected(node, ctx),
                        factors=_carry_leading_factors(ctx.get(x), len(xd) - 1, wd[0], (shape_of(node) or (1,))[-1]))
    return NodeDims(tuple(xd[:-1]) + (frozenset(),), _merge_selected(node, ctx))


@register_dim_rule(aten.einsum)
def _einsum_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    eq, operands = node.args[0], node.args[1]
    lhs, _, rhs = eq.replace(" ", "").partition("->")
    in_specs = lhs.split(",")
    letter: dict[str, set[int]] = {}
    letter_sides: dict[str, list[frozenset[int]]] = {}
    for spec, op in zip(in_specs, operands):
        dims = ctx.dims(op)
        shp = shape_of(op) or ()
        if "..." in spec:
            pre, post = spec.split("...")
            n_ell = len(shp) - len(pre) - len(post)
            names = list(pre) + [f"_e{i}" for i in range(n_ell)] + list(post)
        else:
            names = list(spec)
        for nm, ls, s in zip(names, dims, shp):
            if s != 1:
                letter.setdefault(nm, set()).update(ls)
                letter_sides.setdefault(nm, []).append(ls)
    for sd in letter_sides.values():
        ctx.unify([(ls, None) for ls in sd])
    out_shape = shape_of(node) or ()
    if not rhs:
        rhs = "".join(sorted(c for c in letter if len(c) == 1 and sum(sp.count(c) for sp in in_specs) == 1))
    if "..." in rhs:
        pre, post = rhs.split("...")
        n_ell = len(out_shape) - len(pre) - len(post)
        names = list(pre) + [f"_e{i}" for i in range(n_ell)] + list(post)
    else:
        names = list(rhs)
    return NodeDims(tuple(frozenset(letter.get(n, set())) for n in names), _merge_selected(node, ctx))


@register_dim_rule(aten.conv1d, aten.conv2d, aten.convolution, aten._convolution)
def _conv_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    x, w = node.args[0], node.args[1]
    xd, wd = ctx.dims(x), ctx.dims(w)
    out = (xd[0], wd[0] if wd else frozenset()) + tuple(xd[2:])
    return NodeDims(out, _merge_selected(node, ctx))


# --------------------------------------------------------------------------- reductions & scans


def _reduce_dims(node: fx.Node) -> tuple[list[int] | None, bool]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if isinstance(dims, int):
        dims = [dims]
    return (list(dims) if dims is not None else None), bool(keep)


@register_dim_rule(aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.prod,
                   aten.var, aten.std, aten.norm, aten.linalg_vector_norm, aten.logsumexp,
                   aten.any, aten.all, aten.argmax, aten.argmin, aten.var_mean, aten.std_mean)
def _reduce_rule(node: fx.Node, ctx: _Ctx) -> NodeDims | tuple[NodeDims | None, ...]:
    if len(node.args) > 1 and isinstance(node.args[1], fx.Node):  # max.other / min.other: elementwise
        return pointwise_rule(node, ctx)
    src = node.args[0]
    dims = ctx.dims(src)
    rd, keep = _reduce_dims(node)
    if node.target in (aten.norm.ScalarOpt_dim, aten.linalg_vector_norm.default):
        rd = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        rd = [rd] if isinstance(rd, int) else (list(rd) if rd is not None else None)
        keep = bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False))
    red = set(range(len(dims))) if not rd else {_norm(d, len(dims)) for d in rd}
    out = tuple((frozenset() if i in red else ls) for i, ls in enumerate(dims) if keep or i not in red)
    nd = NodeDims(out, _merge_selected(node, ctx))
    if isinstance(node.meta.get("val"), (tuple, list)):
        return tuple(nd for _ in node.meta["val"])
    return nd


@register_dim_rule(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.cumsum,
                   aten.cumprod, aten.logcumsumexp, aten.cummax, aten.cummin, aten.layer_norm,
                   aten.rms_norm, aten.group_norm, aten.native_layer_norm, aten.tril, aten.triu,
                   aten.native_group_norm)
def _keep_rank_rule(node: fx.Node, ctx: _Ctx) -> NodeDims | tuple[NodeDims | None, ...]:
    nd = NodeDims(ctx.dims(node.args[0]), _merge_selected(node, ctx))
    if isinstance(node.meta.get("val"), (tuple, list)):
        return (nd,) + tuple(None for _ in node.meta["val"][1:])
    return nd


@register_dim_rule(aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention_for_cpu)
def _sdpa_rule(node: fx.Node, ctx: _Ctx) -> NodeDims | tuple[NodeDims | None, ...]:
    q, k, v = node.args[:3]
    qd, kd, vd = ctx.dims(q), ctx.dims(k), ctx.dims(v)
    ctx.unify([(kd[-2], None), (vd[-2], None)])
    nd = NodeDims(tuple(qd[:-1]) + (vd[-1],), _merge_selected(node, ctx))
    if isinstance(node.meta.get("val"), (tuple, list)):
        return (nd,) + tuple(None for _ in node.meta["val"][1:])
    return nd


@register_dim_rule(aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.mse_loss,
                   aten.l1_loss, aten.binary_cross_entropy_with_logits, aten.smooth_l1_loss)
def _loss_rule(node: fx.Node, ctx: _Ctx) -> NodeDims:
    logits, target = node.args[0], node.args[1]
    ld, td = ctx.dims(logits), ctx.dims(target)
    if node.target in (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default):
        # (N, C, d1..) vs (N, d1..): align class-less positions
        if len(ld) == len(td) + 1:
            for i, ls in enumerate(td):
                j = i if i == 0 else i + 1
                if len(ld) == 2:
                    j = 0
                ctx.unify([(ls, ctx.factors(target, i)), (ld[j], ctx.factors(logits, j))])
    else:
        broadcast_dims(node, ctx, [logits, target])
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    out_shape = shape_of(node) or ()
    if reduction == 0 and out_shape:
        return NodeDims(tuple(td[: len(out_shape)]), _merge_selected(node, ctx))
    return NodeDims((), _merge_selected(node, ctx))


# --------------------------------------------------------------------------- the analysis


def _custom_op_rule(node: fx.Node, ctx: _Ctx) -> NodeDims | tuple[NodeDims | None, ...] | None:
    """gradshard custom ops describe their dims next to their definition (``gs_dims`` attr)."""
    packet = getattr(node.target, "_overloadpacket", None)
    fn = DIM_RULES.get(packet) or DIM_RULES.get(getattr(packet, "_qualified_op_name", None))
    return fn(node, ctx) if fn else None


def analyze_dims(gm: fx.GraphModule) -> DimAnalysis:
    """Label every dimension of every node with the graph-input dimensions it comes from."""
    analysis = DimAnalysis(nodes={}, classes=nx.utils.UnionFind(), input_labels={})
    counter = [0]
    ctx = _Ctx(analysis, counter)
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


def _apply_rule(node: fx.Node, ctx: _Ctx):
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


def product(xs: Iterable[int]) -> int:
    return math.prod(xs)
