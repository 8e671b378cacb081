"""Dimension rules for compute ops: pointwise, matmuls and einsum, reductions, scans, losses.

Registers into :data:`gradshard.analysis.dim_core.DIM_RULES` on import (done by
:mod:`gradshard.analysis.dims`). Pointwise ops unify broadcast dims, matmuls unify and drop
contracted dims (a merged ``B*T`` row dim keeps its factors), reductions drop or keep the
reduced dims.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .dim_core import (DimsContext, Factors, Labels, NodeDims, broadcast_dims, carry_factors, merge_selected,
                       norm_dim, pointwise_rule, register_dim_rule, shape_of)

aten = torch.ops.aten

__all__: list[str] = []  # rules only: everything here is reached through DIM_RULES

# --------------------------------------------------------------------------- pointwise

_SAME_SHAPE_OPS = [
    aten.clone, aten.contiguous, aten.detach, aten.alias, aten._to_copy, aten.to, aten.type_as,
    aten.dropout, aten.native_dropout, aten.masked_fill, aten.where, aten.fill, aten.zeros_like,
    aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like,
    aten.silu, aten.gelu, aten.relu, aten.softplus, aten.sigmoid, aten.tanh, aten.clamp,
    aten.lift_fresh_copy, aten.copy, aten.expand_as,
    aten.masked_fill_, aten.dropout_, aten.feature_dropout, aten.hardtanh,
    aten.leaky_relu, aten.elu, aten.mish, aten.logit, aten.nan_to_num, aten.pow, aten.lerp,
    aten.addcmul, aten.addcdiv, aten.clamp_min, aten.clamp_max, aten.bitwise_not,
    aten.logical_not, aten.logical_and, aten.logical_or, aten.eq, aten.ne, aten.lt, aten.le,
    aten.gt, aten.ge, aten.minimum, aten.maximum, aten.log_sigmoid, aten.hardswish,
    aten.hardsigmoid, aten.relu6, aten.softshrink, aten.hardshrink, aten.selu, aten.celu,
    aten.square, aten.bernoulli,
    # boolean mask algebra (``__and__`` carries no pointwise tag): masks combine as broadcasts
    aten.__and__, aten.__or__, aten.__xor__, aten.bitwise_and, aten.bitwise_or, aten.bitwise_xor,
    aten.logical_xor,
]
register_dim_rule(*_SAME_SHAPE_OPS)(pointwise_rule)


@register_dim_rule(aten.expand, aten.broadcast_to)
def _expand_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    """A pointwise op, except that a dim the input broadcasts (size 1, or new) to a size > 1
    gets a fresh label: a later broadcast against a tensor with that axis unifies the two, so
    ``arange(T).expand(B, T)`` is in the batch's class along dim 0, not an axis of its own."""
    nd = pointwise_rule(node, ctx)
    shape = shape_of(node) or ()
    dims = tuple(ls if ls or size == 1 else frozenset({ctx.fresh()}) for ls, size in zip(nd.dims, shape))
    return NodeDims(dims, nd.selected, factors=nd.factors)


def _partly_written_dims(dest: Any) -> set[int]:
    """Dims along which ``dest`` is a strict sub-range (a chain of ``slice``/``narrow``) of a longer buffer."""
    out: set[int] = set()
    while isinstance(dest, fx.Node) and dest.target in (aten.slice.Tensor, aten.narrow.default):
        base = dest.args[0]
        shp, base_shp = shape_of(dest), shape_of(base) if isinstance(base, fx.Node) else None
        if shp is None or base_shp is None or len(shp) != len(base_shp):
            break
        d = norm_dim(dest.args[1] if len(dest.args) > 1 else 0, len(shp))
        if shp[d] != base_shp[d]:
            out.add(d)
        dest = base
    return out


@register_dim_rule(aten.copy_)
def _copy_into_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    """``dest.copy_(src)`` unifies dims as a pointwise op does, except along a dim where ``dest`` is
    a strict slice of a longer buffer: that axis is a concatenation of written pieces, as in ``cat``
    (``states[:, k*d:(k+1)*d] = C_k`` stacks per-chunk states along a (chunk, d) axis), so the
    piece's axis (``d``) is not the buffer's."""
    dest, src = node.args[0], node.args[1]
    partial = _partly_written_dims(dest)
    if not partial or not isinstance(src, fx.Node):
        return pointwise_rule(node, ctx)
    out_shape, src_shape = shape_of(node) or (), shape_of(src) or ()
    dest_dims, src_dims = ctx.dims(dest), ctx.dims(src)
    off = len(out_shape) - len(src_shape)
    for i, (size, ls) in enumerate(zip(src_shape, src_dims)):
        j = i + off
        if 0 <= j < len(out_shape) and j not in partial and size == out_shape[j] and size != 1:
            ctx.unify([(dest_dims[j], ctx.factors(dest, j)), (ls, ctx.factors(src, i))])
    d = ctx.get(dest)
    return NodeDims(tuple(dest_dims), merge_selected(node, ctx), factors=d.factors if d is not None else None)


@register_dim_rule(aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full)
def _new_tensor_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    """``x.new_zeros(shape)`` reads only x's dtype/device: fresh labels, nothing inherited."""
    return NodeDims(ctx.fresh_dims(shape_of(node) or ()))


# --------------------------------------------------------------------------- contractions


def _matmul_dims(a: Labels, b: Labels, sa: tuple[int, ...], sb: tuple[int, ...],
                 out_shape: tuple[int, ...], ctx: DimsContext) -> Labels:
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
                    ctx: DimsContext) -> tuple[Factors, ...] | None:
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
def _matmul_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    a, b = node.args[0], node.args[1]
    out_shape = shape_of(node) or ()
    dims = _matmul_dims(ctx.dims(a), ctx.dims(b), shape_of(a) or (), shape_of(b) or (), out_shape, ctx)
    return NodeDims(dims, merge_selected(node, ctx), factors=_matmul_factors(a, b, out_shape, dims, ctx))


@register_dim_rule(aten.baddbmm, aten.addmm, aten.addbmm)
def _addmm_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    bias, a, b = node.args[0], node.args[1], node.args[2]
    mm = _matmul_dims(ctx.dims(a), ctx.dims(b), shape_of(a) or (), shape_of(b) or (), shape_of(node) or (), ctx)
    bd = broadcast_dims(node, ctx, [bias])
    for x, y in zip(mm, bd.dims):  # the bias is added elementwise: its full-size dims are the product's
        if x and y:
            ctx.unify([(x, None), (y, None)])
    dims = tuple(x | y for x, y in zip(mm, bd.dims))
    ad = ctx.get(a)
    factors = None
    if ad is not None and ad.factors is not None and len(shape_of(a) or ()) == 2 and len(dims) == 2:
        factors = (ad.factors[0], ((dims[1], (shape_of(node) or (0, 0))[1]),) if dims[1] else ())
    elif node.target is aten.baddbmm.default:
        factors = _bias_checked_factors(_matmul_factors(a, b, shape_of(node) or (), dims, ctx), dims,
                                        shape_of(node) or ())
    return NodeDims(dims, merge_selected(node, ctx), factors=factors)


def _bias_checked_factors(factors: tuple[Factors, ...] | None, dims: Labels,
                          out_shape: tuple[int, ...]) -> tuple[Factors, ...] | None:
    """The product's factors, kept per dim only where they cover all of the dim's labels (a
    bias that brings its own labels to a merged dim makes it one factor again): a ``bmm``
    over a merged ``B*T`` row dim plus a bias stays splittable into ``B`` and ``T``."""
    if factors is None:
        return None
    out: list[Factors] = []
    for fs, ls, size in zip(factors, dims, out_shape):
        covered = frozenset().union(*(f for f, _ in fs)) if fs else frozenset()
        out.append(fs if ls <= covered else (((ls, size),) if ls and size != 1 else ()))
    return tuple(out)


@register_dim_rule(aten.linear)
def _linear_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    x, w = node.args[0], node.args[1]
    xd = ctx.dims(x)
    wd = ctx.dims(w)
    if len(wd) == 2:
        ctx.unify([(xd[-1], None), (wd[1], None)])
        return NodeDims(tuple(xd[:-1]) + (wd[0],), merge_selected(node, ctx),
                        factors=_carry_leading_factors(ctx.get(x), len(xd) - 1, wd[0], (shape_of(node) or (1,))[-1]))
    return NodeDims(tuple(xd[:-1]) + (frozenset(),), merge_selected(node, ctx))


def _einsum_names(spec: str, rank: int) -> list[str]:
    """One name per dim of an einsum operand ``spec`` of rank ``rank`` (``...`` -> ``_e0, _e1, ..``)."""
    if "..." not in spec:
        return list(spec)
    pre, post = spec.split("...")
    return list(pre) + [f"_e{i}" for i in range(rank - len(pre) - len(post))] + list(post)


@register_dim_rule(aten.einsum)
def _einsum_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    eq, operands = node.args[0], node.args[1]
    lhs, _, rhs = eq.replace(" ", "").partition("->")
    in_specs = lhs.split(",")
    letter: dict[str, set[int]] = {}
    letter_sides: dict[str, list[frozenset[int]]] = {}
    for spec, op in zip(in_specs, operands):
        dims = ctx.dims(op)
        shp = shape_of(op) or ()
        for nm, ls, s in zip(_einsum_names(spec, len(shp)), dims, shp):
            if s != 1:
                letter.setdefault(nm, set()).update(ls)
                letter_sides.setdefault(nm, []).append(ls)
    for sd in letter_sides.values():
        ctx.unify([(ls, None) for ls in sd])
    out_shape = shape_of(node) or ()
    if not rhs:
        rhs = "".join(sorted(c for c in letter if len(c) == 1 and sum(sp.count(c) for sp in in_specs) == 1))
    names = _einsum_names(rhs, len(out_shape))
    return NodeDims(tuple(frozenset(letter.get(n, set())) for n in names), merge_selected(node, ctx))


@register_dim_rule(aten.conv1d, aten.conv2d, aten.convolution, aten._convolution)
def _conv_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    x, w = node.args[0], node.args[1]
    xd, wd = ctx.dims(x), ctx.dims(w)
    out = (xd[0], wd[0] if wd else frozenset()) + tuple(xd[2:])
    return NodeDims(out, merge_selected(node, ctx))


# --------------------------------------------------------------------------- reductions & scans


def _first_output(node: fx.Node, nd: NodeDims) -> NodeDims | tuple[NodeDims | None, ...]:
    """``nd`` for a one-output op; for a multi-output op (``native_layer_norm``), ``nd`` for
    the first output and nothing known of the others (statistics)."""
    if isinstance(node.meta.get("val"), (tuple, list)):
        return (nd,) + tuple(None for _ in node.meta["val"][1:])
    return nd


def _reduce_dims(node: fx.Node) -> tuple[list[int] | None, bool]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if isinstance(dims, int):
        dims = [dims]
    return (list(dims) if dims is not None else None), bool(keep)


@register_dim_rule(aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.prod,
                   aten.var, aten.std, aten.norm, aten.linalg_vector_norm, aten.logsumexp,
                   aten.any, aten.all, aten.argmax, aten.argmin, aten.var_mean, aten.std_mean)
def _reduce_rule(node: fx.Node, ctx: DimsContext) -> NodeDims | tuple[NodeDims | None, ...]:
    if len(node.args) > 1 and isinstance(node.args[1], fx.Node):  # max.other / min.other: elementwise
        return pointwise_rule(node, ctx)
    src = node.args[0]
    dims = ctx.dims(src)
    rd, keep = _reduce_dims(node)
    if node.target in (aten.norm.ScalarOpt_dim, aten.linalg_vector_norm.default):
        rd = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        rd = [rd] if isinstance(rd, int) else (list(rd) if rd is not None else None)
        keep = bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False))
    red = set(range(len(dims))) if not rd else {norm_dim(d, len(dims)) for d in rd}
    out = tuple((frozenset() if i in red else ls) for i, ls in enumerate(dims) if keep or i not in red)
    source = [None if i in red else i for i in range(len(dims)) if keep or i not in red]
    nd = NodeDims(out, merge_selected(node, ctx),
                  factors=carry_factors(ctx.get(src), shape_of(src) or (), out, _out_shape(node), source))
    if isinstance(node.meta.get("val"), (tuple, list)):
        return tuple(nd for _ in node.meta["val"])
    return nd


@register_dim_rule(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.cumsum,
                   aten.cumprod, aten.logcumsumexp, aten.cummax, aten.cummin, aten.layer_norm,
                   aten.rms_norm, aten.group_norm, aten.native_layer_norm, aten.tril, aten.triu,
                   aten.native_group_norm)
def _keep_rank_rule(node: fx.Node, ctx: DimsContext) -> NodeDims | tuple[NodeDims | None, ...]:
    src = node.args[0]
    dims = ctx.dims(src)
    shp = shape_of(src) or ()
    nd = NodeDims(dims, merge_selected(node, ctx),
                  factors=carry_factors(ctx.get(src), shp, dims, _out_shape(node), range(len(dims))))
    return _first_output(node, nd)


def _out_shape(node: fx.Node) -> tuple[int, ...]:
    """Shape of ``node``'s (first) output."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)) and val and isinstance(val[0], torch.Tensor):
        return tuple(int(s) for s in val[0].shape)
    return shape_of(node) or ()


@register_dim_rule(aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention_for_cpu)
def _sdpa_rule(node: fx.Node, ctx: DimsContext) -> NodeDims | tuple[NodeDims | None, ...]:
    q, k, v = node.args[:3]
    qd, kd, vd = ctx.dims(q), ctx.dims(k), ctx.dims(v)
    ctx.unify([(kd[-2], None), (vd[-2], None)])
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node) and node.target is aten.scaled_dot_product_attention.default:
        # the mask broadcasts against the scores (..., L, S): its dims are the query's batch
        # dims, the query length and the key length
        target = [(s, ls) for s, ls in zip(_out_shape(q), qd)][:-1]
        target.append(((shape_of(k) or (0, 0))[-2], kd[-2]))
        mshape, md = shape_of(mask) or (), ctx.dims(mask)
        off = len(target) - len(mshape)
        for i, (size, ls) in enumerate(zip(mshape, md)):
            if 0 <= i + off < len(target) and size == target[i + off][0] and size != 1:
                ctx.unify([(ls, ctx.factors(mask, i)), (target[i + off][1], None)])
    nd = NodeDims(tuple(qd[:-1]) + (vd[-1],), merge_selected(node, ctx))
    return _first_output(node, nd)


@register_dim_rule(aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.mse_loss,
                   aten.l1_loss, aten.binary_cross_entropy_with_logits, aten.smooth_l1_loss)
def _loss_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
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
        return NodeDims(tuple(td[: len(out_shape)]), merge_selected(node, ctx))
    return NodeDims((), merge_selected(node, ctx))

