"""Dimension rules for layout ops: views, transposes, repeats, indexing, cat/stack/split.

Registers into :data:`gradshard.analysis.dim_core.DIM_RULES` on import (done by
:mod:`gradshard.analysis.dims`). Views split and merge dims by matching size products (a
merged dim remembers its factors); a dim split into pieces with fresh labels is recorded
(:class:`SplitRecord`), so merging exactly those pieces back, in order, restores the dim's
labels (a time axis reshaped into ``(T/c, c)`` blocks and back is the time axis again);
``select`` remembers the label it removed so a ``stack``/``cat`` of per-step pieces gives
the new dim that label again.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from .dim_core import (DimsContext, Factors, Labels, NodeDims, SplitRecord, carry_factors, iota_length,
                       merge_selected, norm_dim, register_dim_rule, shape_of)

aten = torch.ops.aten

__all__ = ["reshape_labels"]

# --------------------------------------------------------------------------- views


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
def _reshape_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    src = node.args[0]
    in_shape, out_shape = shape_of(src) or (), shape_of(node) or ()
    d = ctx.get(src)
    labels = d.dims if d else ctx.fresh_dims(in_shape)
    dims, factors = reshape_labels(in_shape, out_shape, labels, d.factors if d else None)
    dims, factors = _restore_split_wholes(dims, factors, ctx)
    dims, factors = _unshare_unlinked_split(dims, factors, out_shape, ctx)
    return NodeDims(dims, d.selected if d else frozenset(), factors=factors)


def _restore_split_wholes(dims: Labels, factors: tuple[Factors, ...],
                          ctx: DimsContext) -> tuple[Labels, tuple[Factors, ...]]:
    """Give a merged dim the labels of the dim it was split from when it merges those pieces back.

    A split whose pieces got fresh labels (:func:`_unshare_unlinked_split`) is recorded; a
    merged dim whose factors hold, consecutively and in order, factors of the same classes and
    sizes as a record's pieces has that run replaced by one factor of the record's ``whole``
    labels. ``(B, T) -> (B, T/c, c) -> ... -> (B, T)`` so gives the time axis back, not a new
    axis that only the blocks share. Nested splits unwind innermost first.
    """
    if not ctx.a.splits or all(len(fs) < 2 for fs in factors):
        return dims, factors
    canon = ctx.a.canon
    by_first: dict[int, list[SplitRecord]] = {}  # records by the class of their first piece
    for rec in ctx.a.splits:
        by_first.setdefault(canon(rec.pieces[0][0]), []).append(rec)
    out, out_f = list(dims), list(factors)
    for k, fs in enumerate(factors):
        if len(fs) < 2:
            continue
        merged = _merge_recorded_runs(fs, by_first, canon)
        if merged != fs:
            out[k] = frozenset().union(*(ls for ls, _ in merged))
            out_f[k] = merged
    return tuple(out), tuple(out_f)


def _merge_recorded_runs(fs: Factors, by_first: dict[int, list[SplitRecord]],
                         canon: Callable[[int], int]) -> Factors:
    """``fs`` with every run of factors that matches a :class:`SplitRecord` replaced by its whole."""
    while len(fs) >= 2:
        classes = [_single_class(ls, canon) for ls, _ in fs]
        hit = next(((i, rec) for i, c in enumerate(classes) if c is not None for rec in by_first.get(c, ())
                    if _run_matches(fs, classes, i, rec, canon)), None)
        if hit is None:
            break
        i, rec = hit
        size = 1
        for _, s in rec.pieces:
            size *= s
        fs = (*fs[:i], (rec.whole, size), *fs[i + len(rec.pieces):])
    return fs


def _single_class(labels: frozenset[int], canon: Callable[[int], int]) -> int | None:
    """The class of ``labels`` when they all belong to one, else None."""
    found = {canon(l) for l in labels}
    return next(iter(found)) if len(found) == 1 else None


def _run_matches(fs: Factors, classes: list[int | None], i: int, rec: SplitRecord,
                 canon: Callable[[int], int]) -> bool:
    """Do the factors from ``i`` on have the classes and sizes of ``rec``'s pieces, in order?"""
    n = len(rec.pieces)
    return i + n <= len(fs) and all(classes[i + j] == canon(lab) and fs[i + j][1] == size
                                    for j, (lab, size) in enumerate(rec.pieces))


def _unshare_unlinked_split(dims: Labels, factors: tuple[Factors, ...], out_shape: tuple[int, ...],
                            ctx: DimsContext) -> tuple[Labels, tuple[Factors, ...]]:
    """Give each piece of a split dim a fresh label when the dim's labels are linked to nothing yet.

    A split off factor boundaries gives every piece the dim's labels; for an axis with no
    provenance (a buffer from ``zeros``, filled piecewise along a ``(chunk, d)`` axis) that shared
    label would later tie the pieces together, e.g. a chunk index to a head dim. The split is
    recorded (``ctx.a.splits``) so that merging the pieces back restores the dim's labels.
    """
    seen: dict[frozenset[int], int] = {}
    for ls, size in zip(dims, out_shape):
        if ls and size != 1:
            seen[ls] = seen.get(ls, 0) + 1
    weights = ctx.a.classes.weights
    shared = {ls for ls, k in seen.items() if k > 1 and all(weights[ctx.a.classes[l]] == 1 for l in ls)}
    if not shared:
        return dims, factors
    out, out_f = list(dims), list(factors)
    pieces: dict[frozenset[int], list[tuple[int, int]]] = {ls: [] for ls in shared}
    for i, (ls, size) in enumerate(zip(dims, out_shape)):
        if ls in shared and size != 1:
            label = ctx.fresh()
            fresh = frozenset([label])
            out[i], out_f[i] = fresh, ((fresh, size),)
            pieces[ls].append((label, size))
    ctx.a.splits.extend(SplitRecord(ls, tuple(ps)) for ls, ps in pieces.items())
    return tuple(out), tuple(out_f)


@register_dim_rule(aten.transpose, aten.swapaxes, aten.swapdims)
def _transpose_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    d = ctx.get(node.args[0])
    dims = list(d.dims if d else ctx.fresh_dims(shape_of(node.args[0]) or ()))
    a, b = norm_dim(node.args[1], len(dims)), norm_dim(node.args[2], len(dims))
    dims[a], dims[b] = dims[b], dims[a]
    factors = list(d.factors) if d is not None and d.factors is not None else None
    if factors is not None:
        factors[a], factors[b] = factors[b], factors[a]
    return NodeDims(tuple(dims), d.selected if d else frozenset(), factors=tuple(factors) if factors else None)


@register_dim_rule(aten.t)
def _t_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    dims = ctx.dims(node.args[0])
    return NodeDims(tuple(reversed(dims)), merge_selected(node, ctx))


@register_dim_rule(aten.permute)
def _permute_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    d = ctx.get(node.args[0])
    dims = ctx.dims(node.args[0])
    perm = [norm_dim(p, len(dims)) for p in node.args[1]]
    factors = tuple(d.factors[p] for p in perm) if d is not None and d.factors is not None else None
    return NodeDims(tuple(dims[p] for p in perm), merge_selected(node, ctx), factors=factors)


@register_dim_rule(aten.movedim)
def _movedim_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    dims = list(ctx.dims(node.args[0]))
    src, dst = node.args[1], node.args[2]
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    nd = len(dims)
    src = [norm_dim(s, nd) for s in src]
    dst = [norm_dim(s, nd) for s in dst]
    order = [i for i in range(nd) if i not in src]
    out: list[Any] = [None] * nd
    for s, t in zip(src, dst):
        out[t] = dims[s]
    it = iter(order)
    for i in range(nd):
        if out[i] is None:
            out[i] = dims[next(it)]
    return NodeDims(tuple(out), merge_selected(node, ctx))


@register_dim_rule(aten.repeat)
def _repeat_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    dims = ctx.dims(node.args[0])
    reps = list(node.args[1])
    pad = len(reps) - len(dims)
    full = (frozenset(),) * pad + tuple(dims)
    out = tuple(ls if r == 1 else frozenset() for ls, r in zip(full, reps))
    return NodeDims(out, merge_selected(node, ctx))


@register_dim_rule(aten.repeat_interleave)
def _repeat_interleave_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    src = node.args[0]
    if not isinstance(src, fx.Node) or shape_of(src) is None:
        return NodeDims(ctx.fresh_dims(shape_of(node) or ()))
    dims = list(ctx.dims(src))
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
    if dim is None:
        return NodeDims(ctx.fresh_dims(shape_of(node) or ()))
    d = norm_dim(dim, len(dims))
    repeats = node.kwargs.get("repeats", node.args[1] if len(node.args) > 1 else None)
    if not isinstance(repeats, int):  # tensor-valued repeats: a data-dependent new axis
        dims[d] = frozenset()
        return NodeDims(tuple(dims), merge_selected(node, ctx))
    # integer repeats: element i of the output dim is element i // r of the input dim, a merged
    # dim (input dim, r) -- tokens copied once per chosen expert keep their batch and time
    in_shape, out_shape = shape_of(src) or (), shape_of(node) or ()
    sd = ctx.get(src)
    own = carry_factors(sd, in_shape, tuple(dims), in_shape, range(len(dims))) if sd is not None else None
    if own is None:
        own = tuple(((ls, s),) if ls and s != 1 else () for ls, s in zip(dims, in_shape))
    factors = list(own)
    factors[d] = tuple(own[d]) + (((frozenset(), repeats),) if repeats != 1 else ())
    if in_shape[d] == 1:
        dims[d] = frozenset()
    return NodeDims(tuple(dims), merge_selected(node, ctx), factors=tuple(factors))


# --------------------------------------------------------------------------- indexing


@register_dim_rule(aten.select)
def _select_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    d = ctx.get(node.args[0])
    dims = list(d.dims if d else ctx.fresh_dims(shape_of(node.args[0]) or ()))
    dim = norm_dim(node.args[1], len(dims))
    removed = dims.pop(dim)
    sel = (d.selected if d else frozenset()) | removed
    return NodeDims(tuple(dims), sel, index=int(node.args[2]))


@register_dim_rule(aten.slice, aten.narrow, aten.index_select, aten.constant_pad_nd, aten.pad,
                   aten.roll, aten.flip, aten.gather, aten.scatter, aten.index_add, aten.index_copy)
def _same_rank_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    """Rank-preserving indexing: each output dim keeps its input labels (sizes may change; a
    dim of unchanged size keeps its factors)."""
    src = node.args[0]
    dims = ctx.dims(src)
    return NodeDims(dims, merge_selected(node, ctx),
                    factors=carry_factors(ctx.get(src), shape_of(src) or (), dims, shape_of(node) or (),
                                          range(len(dims))))


@register_dim_rule(aten.index)
def _index_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    """``x[i0, i1, ...]``: a dim indexed by ``arange`` over its whole size is the index's axis
    (:func:`_unify_iota_indices`); one index tensor puts its dims in place of the indexed dim;
    several adjacent ones put their broadcast dims there (``mask[b_idx, kv_idx]``, as
    transformers' padding masks read the attention mask); other forms get fresh labels."""
    src, idx = node.args[0], node.args[1]
    _unify_iota_indices(src, idx, ctx)
    dims = list(ctx.dims(src))
    out_shape = shape_of(node) or ()
    idx_nodes = [i for i in idx if i is not None]
    if len(idx_nodes) == 1 and all(i is None for i in idx[: idx.index(idx_nodes[0])]):
        k = idx.index(idx_nodes[0])
        idx_dims = ctx.dims(idx_nodes[0]) if isinstance(idx_nodes[0], fx.Node) else ()
        out = tuple(dims[:k]) + tuple(idx_dims) + tuple(dims[k + 1 :])
        if len(out) == len(out_shape):
            return NodeDims(out, merge_selected(node, ctx), factors=_index_factors(node, ctx, k, out, out_shape))
    positions = [j for j, i in enumerate(idx) if i is not None]
    if (len(positions) > 1 and positions == list(range(positions[0], positions[-1] + 1))
            and all(isinstance(idx[j], fx.Node) and shape_of(idx[j]) is not None for j in positions)):
        k0, k1 = positions[0], positions[-1] + 1
        n_b = len(out_shape) - (len(dims) - (k1 - k0))
        b_shape = out_shape[k0:k0 + n_b]
        labels: list[set[int]] = [set() for _ in b_shape]
        for j in positions:
            ishape, idims = shape_of(idx[j]), ctx.dims(idx[j])
            off = n_b - len(ishape)
            for i, (size, ls) in enumerate(zip(ishape, idims)):
                if 0 <= i + off < n_b and size == b_shape[i + off] and size != 1:
                    labels[i + off] |= ls
        for ls in labels:
            ctx.union(ls)
        out = tuple(dims[:k0]) + tuple(frozenset(ls) for ls in labels) + tuple(dims[k1:])
        if len(out) == len(out_shape):
            return NodeDims(out, merge_selected(node, ctx))
    return NodeDims(ctx.fresh_dims(out_shape))


def _unify_iota_indices(src: Any, idx: Any, ctx: DimsContext) -> None:
    """``x[..., arange(n), ...]`` with ``n`` the size of the indexed dim reads that dim in order:
    the index's one non-1 dim and the indexed dim are the same axis."""
    src_shape, src_dims = shape_of(src) if isinstance(src, fx.Node) else None, ctx.dims(src)
    if src_shape is None:
        return
    for j, i in enumerate(idx):
        if j >= len(src_shape) or not isinstance(i, fx.Node) or src_shape[j] == 1:
            continue
        ishape = shape_of(i) or ()
        wide = [d for d, size in enumerate(ishape) if size != 1]
        if len(wide) == 1 and ishape[wide[0]] == src_shape[j] and iota_length(i) == src_shape[j]:
            ctx.unify([(src_dims[j], ctx.factors(src, j)), (ctx.dims(i)[wide[0]], ctx.factors(i, wide[0]))])


def _index_factors(node: fx.Node, ctx: DimsContext, k: int, out: Labels,
                   out_shape: tuple[int, ...]) -> tuple[Factors, ...] | None:
    """Factors of ``x[..., idx, ...]`` (one index tensor at dim ``k``): the index's dims keep the
    index's factors (rows gathered per token keep a merged ``B*T``), the others ``x``'s."""
    src, idx = node.args[0], node.args[1][k]
    sd, idd = ctx.get(src), ctx.get(idx) if isinstance(idx, fx.Node) else None
    if (sd is None or sd.factors is None) and (idd is None or idd.factors is None):
        return None
    src_shape, idx_shape = shape_of(src) or (), shape_of(idx) or ()
    n_idx = len(idx_shape)
    res: list[Factors] = []
    for i, (ls, size) in enumerate(zip(out, out_shape)):
        if k <= i < k + n_idx:
            d, j, shp = idd, i - k, idx_shape
        else:
            d, j, shp = sd, (i if i < k else i - n_idx + 1), src_shape
        if d is not None and d.factors is not None and j < len(d.factors) and shp[j] == size and d.factors[j]:
            res.append(d.factors[j])
        else:
            res.append(((ls, size),) if ls and size != 1 else ())
    return tuple(res)


@register_dim_rule(aten.topk, aten.sort, aten.argsort)
def _select_along_rule(node: fx.Node, ctx: DimsContext) -> NodeDims | tuple[NodeDims, ...]:
    """Top-k / sort along one dim: the other dims keep their labels and factors; the selected
    dim is a new axis (positions in the ranking, not the input's positions), one label shared
    by the values and the indices."""
    src = node.args[0]
    in_shape = shape_of(src) or ()
    dims = list(ctx.dims(src))
    pos = 2 if node.target is aten.topk.default else 1
    dim = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", -1)
    if isinstance(dim, bool) or not isinstance(dim, int):  # sort.stable takes the dim as a keyword
        dim = node.kwargs.get("dim", -1)
    d = norm_dim(dim, max(len(dims), 1))
    val = node.meta.get("val")
    first = val[0] if isinstance(val, (tuple, list)) else val
    out_shape = tuple(int(s) for s in first.shape) if isinstance(first, torch.Tensor) else in_shape
    if d < len(dims):
        dims[d] = frozenset([ctx.fresh()]) if out_shape[d] != 1 else frozenset()
    source = [None if i == d else i for i in range(len(dims))]
    nd = NodeDims(tuple(dims), merge_selected(node, ctx),
                  factors=carry_factors(ctx.get(src), in_shape, tuple(dims), out_shape, source))
    if isinstance(val, (tuple, list)):
        return tuple(nd for _ in val)
    return nd


@register_dim_rule(aten.embedding)
def _embedding_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    weight, idx = node.args[0], node.args[1]
    return NodeDims(tuple(ctx.dims(idx)) + (ctx.dims(weight)[-1],), merge_selected(node, ctx))


@register_dim_rule(aten.cat, aten.concat, aten.concatenate)
def _cat_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    pieces = [p for p in node.args[0] if isinstance(p, fx.Node)]
    out_shape = shape_of(node) or ()
    dim = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(out_shape))
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
def _stack_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    pieces = [p for p in node.args[0] if isinstance(p, fx.Node)]
    out_shape = shape_of(node) or ()
    dim = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(out_shape))
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
def _split_rule(node: fx.Node, ctx: DimsContext) -> tuple[NodeDims | None, ...]:
    d = ctx.get(node.args[0])
    vals = node.meta.get("val") or ()
    dims = d.dims if d else ()
    if node.target is aten.unbind.int:
        dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(dims))
        rest = tuple(x for i, x in enumerate(dims) if i != dim)
        return tuple(NodeDims(rest, (d.selected if d else frozenset()) | dims[dim], index=i) for i in range(len(vals)))
    in_shape = shape_of(node.args[0]) or ()
    return tuple(NodeDims(dims, d.selected if d else frozenset(),
                          factors=carry_factors(d, in_shape, dims, tuple(int(s) for s in v.shape), range(len(dims)))
                          if isinstance(v, torch.Tensor) else None)
                 for v in vals)


@register_dim_rule(operator.getitem)
def _getitem_rule(node: fx.Node, ctx: DimsContext) -> NodeDims | None:
    src = ctx.a.nodes.get(node.args[0].name) if isinstance(node.args[0], fx.Node) else None
    if isinstance(src, tuple) and isinstance(node.args[1], int) and node.args[1] < len(src):
        return src[node.args[1]]
    return None

