"""Chunk rules for ops that read each step's own window: pointwise ops, views, indexing,
slices/pads/concatenations along time (a shift of the window), factories (``arange``,
``full``, ``zeros`` sized by the window) and ``triu``/``tril`` (diagonal moved by the window
offsets). Registered into :data:`gradshard.plans.chunked.rules.CHUNK_RULES` on import.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from gradshard.errors import node_error
from gradshard.plans.chunked.frames import SKIP, Demand, DimMap, Frame, TDim
from gradshard.plans.chunked.rules import (
    BuildCtx, default_run, meta_shape, NodeRule, positional, rebuild_args, register_chunk_rule,
    slots_of, _arg, _check_unframed_args, _frame_from, _index_of, _INSTEAD, _norm, op_name,
)

aten = torch.ops.aten


# --------------------------------------------------------------------------- pointwise


def _broadcast_mapper(node: fx.Node) -> Callable[[int, fx.Node, TDim], TDim | None]:
    out = meta_shape(node)

    def mapper(i: int, a: fx.Node, td: TDim) -> TDim | None:
        shp = meta_shape(a)
        j = td.dim + len(out) - len(shp)
        if j < 0 or j >= len(out) or out[j] != shp[td.dim]:
            return None
        return replace(td, dim=j)

    return mapper


def pointwise_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    rule = positional(node, bc, _broadcast_mapper(node))
    _check_unframed_args(node, bc, rule.frame)
    return rule


_POINTWISE = [
    aten.clone, aten.contiguous, aten.detach, aten.alias, aten._to_copy, aten.to, aten.type_as,
    aten.masked_fill, aten.where, aten.fill, aten.zeros_like, aten.ones_like, aten.empty_like,
    aten.full_like, aten.silu, aten.gelu, aten.relu, aten.softplus, aten.sigmoid, aten.tanh,
    aten.clamp, aten.copy, aten.expand_as, aten.hardtanh, aten.leaky_relu, aten.elu, aten.mish,
    aten.logit, aten.nan_to_num, aten.pow, aten.lerp, aten.addcmul, aten.addcdiv, aten.clamp_min,
    aten.clamp_max, aten.bitwise_not, aten.logical_not, aten.logical_and, aten.logical_or, aten.eq,
    aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.minimum, aten.maximum, aten.view_as,
    aten.reshape_as, aten.lift_fresh_copy, aten.mse_loss, aten.l1_loss, aten.smooth_l1_loss,
    aten.binary_cross_entropy_with_logits, aten.sub, aten.add, aten.mul, aten.div, aten.neg,
    aten.exp, aten.log, aten.rsqrt, aten.sqrt, aten.square, aten.abs, aten.sin, aten.cos,
    aten.erf, aten.reciprocal, aten.log1p, aten.expm1, aten.sign, aten.floor, aten.ceil,
    aten.round, aten.trunc, aten.remainder, aten.fmod, aten.bitwise_and, aten.bitwise_or,
    aten.bitwise_xor, aten.__and__, aten.__or__, aten.__xor__, aten.logaddexp, aten.atan2, aten.hypot, aten.xlogy,
    aten.log_sigmoid,
]
register_chunk_rule(*_POINTWISE, "pointwise")(pointwise_rule)


@register_chunk_rule(aten.dropout, aten.native_dropout, aten.feature_dropout, aten.bernoulli,
                     aten.rand_like, aten.randn_like, aten.rand, aten.randn, aten.randint, aten.normal,
                     aten.uniform, aten.randperm, aten.multinomial)
def _random_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    if node.target in (aten.dropout.default, aten.feature_dropout.default):
        p, train = _arg(node, 1, "p", 0.0), _arg(node, 2, "train", False)
        if p == 0 or not train:
            return pointwise_rule(node, bc)
    raise node_error(node, f"{op_name(node)} draws random numbers: the chunked backward recomputes "
                     "the forward, which would draw different numbers and give a wrong gradient",
                     "disable dropout/noise for chunked training (model.eval() or p=0), or use "
                     "plan='none'")


# --------------------------------------------------------------------------- views


def reshape_time(in_shape: Sequence[int], out_shape: Sequence[int], td: TDim) -> TDim | None:
    """Where the time digit of ``td`` lands in a row-major reshape (None: it is split, or a dim
    with a tail is merged with another)."""
    if td.tail:  # steps and their tail stay one whole dim: the same size, the same dims inside it
        inside = math.prod(in_shape[td.dim + 1:])
        n = in_shape[td.dim]
        return next((replace(td, dim=j) for j in range(len(out_shape))
                     if out_shape[j] == n and math.prod(out_shape[j + 1:]) == inside), None)
    stride = td.inner * math.prod(in_shape[td.dim + 1:])
    span = stride * td.length
    for j in range(len(out_shape)):
        below = math.prod(out_shape[j + 1:])
        above = below * out_shape[j]
        if below <= stride and span <= above and stride % below == 0 and above % span == 0:
            if out_shape[j] == 1:
                continue
            return TDim(j, td.length, stride // below)
    return None


def _view_mapper(node: fx.Node) -> Callable[[int, fx.Node, TDim], TDim | None]:
    out = meta_shape(node)

    def mapper(i: int, a: fx.Node, td: TDim) -> TDim | None:
        return reshape_time(meta_shape(a), out, td) if i == 0 else None

    return mapper


def _new_shape(node: fx.Node, frame: Frame, demand: Demand) -> list[int]:
    shape = list(meta_shape(node))
    for t, (lo, hi) in zip(frame, demand):
        shape[t.dim] = t.size(shape[t.dim], hi - lo)
    return shape


def _reshape_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    rule = ev.program.rules[node.name]
    return torch.reshape(vals[0], _new_shape(node, rule.frame, demand))


@register_chunk_rule(aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten)
def _view_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    rule = positional(node, bc, _view_mapper(node), run=_reshape_run)
    if len(slots_of(node)) != 1:
        raise node_error(node, "a reshape with tensor-valued sizes", _INSTEAD)
    return rule


@register_chunk_rule(aten.squeeze, aten.unsqueeze)
def _squeeze_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    return positional(node, bc, _view_mapper(node))


def _permute_mapper(node: fx.Node) -> Callable[[int, fx.Node, TDim], TDim | None]:
    nd = len(meta_shape(node))
    t = node.target
    if t in (aten.permute.default,):
        perm = [_norm(p, nd) for p in node.args[1]]
    elif t is aten.t.default:
        perm = list(reversed(range(nd)))
    elif t in (aten.movedim.int,):
        src, dst = _norm(node.args[1], nd), _norm(node.args[2], nd)
        order = [i for i in range(nd) if i != src]
        order.insert(dst, src)
        perm = order
    else:  # transpose / swapaxes / swapdims
        a, b = _norm(node.args[1], nd), _norm(node.args[2], nd)
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
    inverse = {p: i for i, p in enumerate(perm)}

    def mapper(i: int, a: fx.Node, td: TDim) -> TDim | None:
        return replace(td, dim=inverse[td.dim])

    return mapper


@register_chunk_rule(aten.view_as_complex, aten.view_as_real)
def _complex_view_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """``view_as_complex`` folds a trailing (real, imaginary) dim of 2 into the dtype, ``view_as_real``
    unfolds it (complex-multiply RoPE): every other dim, time included, keeps its index."""
    src = node.args[0]
    if any(t.dim == len(meta_shape(src)) - 1 for t in bc.frame(src)):
        raise node_error(node, "views the time axis as (real, imaginary) pairs", _INSTEAD)
    return positional(node, bc, lambda i, a, td: td)


@register_chunk_rule(aten.permute, aten.transpose, aten.t, aten.movedim, aten.swapaxes, aten.swapdims)
def _permute_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    if node.target is aten.movedim.intlist:
        raise node_error(node, "movedim with several dims", "use permute")
    return positional(node, bc, _permute_mapper(node))


def _expand_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    """Time dims take the window's size (a 1-step window must not read as a broadcast dim)."""
    sizes = list(node.args[1])
    full = meta_shape(node)
    for t, (lo, hi) in zip(ev.program.rules[node.name].frame, demand):
        sizes[t.dim] = t.size(full[t.dim], hi - lo)
    return vals[0].expand(sizes)


@register_chunk_rule(aten.expand, aten.broadcast_to)
def _expand_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """Time dims of the input keep their place; a dim of size 1 (or a new leading one) expanded
    to the sequence length that the time analysis puts on time (gpt-oss's per-head sink logit
    expanded to every query) becomes a time dim, expanded to the chunk's steps."""
    src = node.args[0]
    out, shp = meta_shape(node), meta_shape(src)
    info = bc.tl.info.get(node.name)
    grown = [TDim(d, out[d]) for d in (info.time_dims if info is not None else ())
             if out[d] == bc.tl.seq_len and (d < len(out) - len(shp) or shp[d - len(out) + len(shp)] == 1)]
    return positional(node, bc, _broadcast_mapper(node), run=_expand_run, extra=grown)


_expand_rule.factory = True  # type: ignore[attr-defined]  # may make time from an input without it


@register_chunk_rule(aten.repeat)
def _repeat_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    reps = list(node.args[1])
    out = meta_shape(node)

    def mapper(i: int, a: fx.Node, td: TDim) -> TDim | None:
        j = td.dim + len(out) - len(meta_shape(a))
        return replace(td, dim=j) if reps[j] == 1 else None

    return positional(node, bc, mapper)


@register_chunk_rule(aten.repeat_interleave)
def _repeat_interleave_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    dim = _arg(node, 2, "dim")
    src = node.args[0]
    if dim is None or not isinstance(src, fx.Node):
        raise node_error(node, "repeat_interleave without a dim flattens the tensor", _INSTEAD)
    d = _norm(dim, len(meta_shape(src)))
    repeats = _arg(node, 1, "repeats")
    if isinstance(repeats, fx.Node):
        if any(t.dim == d for t in bc.frame(src)):
            raise node_error(node, "repeat_interleave along the time axis by tensor-valued repeats", _INSTEAD)
        return positional(node, bc, lambda i, a, td: td if i == 0 else None)
    # integer repeats along time: every element of a step is repeated in place, so the step
    # keeps its window and its digit grows by the repeat count (tokens copied per MoE expert)
    return positional(node, bc, lambda i, a, td: TDim(td.dim, td.length, td.inner * int(repeats))
                      if td.dim == d else td)


# --------------------------------------------------------------------------- indexing


def _slice_params(node: fx.Node) -> tuple[int, int, int, int]:
    src = node.args[0]
    shp = meta_shape(src)
    if node.target is aten.narrow.default:
        dim = _norm(node.args[1], len(shp))
        start = node.args[2] + (shp[dim] if node.args[2] < 0 else 0)
        return dim, start, start + node.args[3], 1
    dim = _norm(_arg(node, 1, "dim", 0), len(shp))
    start = _arg(node, 2, "start", 0)
    end = _arg(node, 3, "end", None)
    step = _arg(node, 4, "step", 1)
    n = shp[dim]
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else (end + n if end < 0 else end)
    return dim, max(0, min(start, n)), max(0, min(end, n)), step


def _identity_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    return vals[0]


@register_chunk_rule(aten.slice, aten.narrow)
def _slice_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    dim, start, end, step = _slice_params(node)
    fr = bc.frame(src)
    hit = [t for t in fr if t.dim == dim]
    if not hit:
        return positional(node, bc, lambda i, a, td: td if i == 0 else None)
    t = hit[0]
    if step != 1:
        raise node_error(node, f"takes every {step}-th step along time", _INSTEAD)
    if t.tail and t.inner == 1 and end <= t.length:  # steps only: the tail dropped (after a sink's softmax)
        t = replace(t, tail=0)
        run: Any = _drop_tail_run
    elif not t.pure(meta_shape(src)[dim]):
        raise node_error(node, "slices a dim in which time is merged with another dim" if not t.tail else
                         "slices a dim of steps and appended positions keeping some of the appended ones",
                         _INSTEAD)
    else:
        run = _identity_run
    out_len = meta_shape(node)[dim]
    frame = _frame_from([TDim(dim, out_len)] + [x for x in fr if x.dim != dim])
    maps = tuple(DimMap("shift", _index_of(frame, dim), start, length=t.length) if x.dim == dim
                 else DimMap("same", _index_of(frame, x.dim)) for x in fr)
    return NodeRule(frame, (maps,), run, note=f"shift {start}" + (", tail dropped" if run is _drop_tail_run else ""))


def _drop_tail_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    """The source's window without the positions after its steps (a tail-dropping slice)."""
    x = vals[0]
    d, src_frame = _norm(_arg(node, 1, "dim", 0), x.dim()), ev.program.rules[node.args[0].name].frame
    return x.narrow(d, 0, x.shape[d] - src_frame[_index_of(src_frame, d)].tail)


@register_chunk_rule(aten.select)
def _select_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    dim = _norm(node.args[1], len(meta_shape(src)))
    if any(t.dim == dim for t in bc.frame(src)):
        raise node_error(node, "selects one time step (a per-step Python loop or x[:, i]); chunked "
                         "plans run the model on windows of steps", "vectorise the loop (cumsum, "
                         "gradshard.kernels.linear_scan) or use plan='none'")
    return positional(node, bc, lambda i, a, td: replace(td, dim=td.dim - (td.dim > dim)))


def _index_rule_mapper(node: fx.Node, bc: BuildCtx) -> Callable[[int, fx.Node, TDim], TDim | None]:
    src, indices = node.args[0], node.args[1]
    idx_pos = [i for i, x in enumerate(indices) if x is not None]
    if len(idx_pos) != 1:
        raise node_error(node, "advanced indexing with several index tensors", _INSTEAD)
    p = idx_pos[0]
    idx = indices[p]
    ni = len(meta_shape(idx)) if isinstance(idx, fx.Node) else 1
    if any(t.dim == p for t in bc.frame(src)):
        raise node_error(node, "gathers along the time axis (reads steps chosen by data)", _INSTEAD)

    def mapper(i: int, a: fx.Node, td: TDim) -> TDim | None:
        if a is src and i == 0:
            return replace(td, dim=td.dim if td.dim < p else td.dim + ni - 1)
        return replace(td, dim=p + td.dim)

    return mapper


@register_chunk_rule(aten.index)
def _index_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    return positional(node, bc, _index_rule_mapper(node, bc))


@register_chunk_rule(aten.embedding)
def _embedding_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    if bc.frame(node.args[0]):
        raise node_error(node, "the embedding table itself runs along time", _INSTEAD)
    return positional(node, bc, lambda i, a, td: td)


@register_chunk_rule(aten.flip, aten.roll)
def _flip_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    nd = len(meta_shape(src))
    dims = node.args[1] if node.target is aten.flip.default else (node.args[2] if len(node.args) > 2 else None)
    dims = [dims] if isinstance(dims, int) else list(dims) if dims is not None else list(range(nd))
    if any(t.dim in {_norm(d, nd) for d in dims} for t in bc.frame(src)):
        what = "reverses" if node.target is aten.flip.default else "rolls"
        raise node_error(node, f"{what} the time axis, so step t reads later steps", _INSTEAD)
    return positional(node, bc, lambda i, a, td: td)


@register_chunk_rule(aten.index_select, aten.gather)
def _gather_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    dim = _norm(node.args[1], len(meta_shape(src)))
    if any(t.dim == dim for t in bc.frame(src)):
        raise node_error(node, "gathers along the time axis (reads steps chosen by data)", _INSTEAD)
    if node.target is aten.index_select.default:
        return positional(node, bc, lambda i, a, td: td if a is src else replace(td, dim=dim))
    return positional(node, bc, lambda i, a, td: td)


#: in-place scatters and their out-of-place twins (a chunk runs the twin: its ``self`` may be a
#: slice of a value the program keeps, which an in-place write would change for a later recompute)
_SCATTERS = {
    aten.scatter_.value: aten.scatter.value, aten.scatter_.src: aten.scatter.src,
    aten.scatter_add_.default: aten.scatter_add.default, aten.scatter_reduce_.two: aten.scatter_reduce.two,
    aten.scatter.value: aten.scatter.value, aten.scatter.src: aten.scatter.src,
    aten.scatter_add.default: aten.scatter_add.default, aten.scatter_reduce.two: aten.scatter_reduce.two,
}


def _scatter_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    args, kwargs = rebuild_args(node, vals)
    return _SCATTERS[node.target](*args, **kwargs)


@register_chunk_rule(aten.scatter, aten.scatter_, aten.scatter_add, aten.scatter_add_, aten.scatter_reduce,
                     aten.scatter_reduce_)
def _scatter_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """Scatter along a dim that is not time (a router marking each token's chosen groups or
    experts): local, each step's row written from that step's index and source; refused along
    time (a step's value would land on steps chosen by data)."""
    if node.target not in _SCATTERS:
        raise node_error(node, f"gradshard has no chunk rule for the `{op_name(node)}` overload", _INSTEAD)
    src = node.args[0]
    dim = _norm(node.args[1], len(meta_shape(src)))
    if any(t.dim == dim for a in (src, node.args[2]) for t in bc.frame(a)):
        raise node_error(node, "scatters along the time axis (writes steps chosen by data)", _INSTEAD)
    return positional(node, bc, lambda i, a, td: td, run=_scatter_run)


def _cat_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    args, kwargs = rebuild_args(node, vals)
    return torch.cat(list(args[0]), *args[1:], **kwargs)


@register_chunk_rule(aten.cat, aten.concat, aten.concatenate)
def _cat_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    out = meta_shape(node)
    dim = _norm(_arg(node, 1, "dim", 0), len(out))
    pieces = [p for p in node.args[0] if isinstance(p, fx.Node)]
    along = [t for p in pieces for t in bc.frame(p) if t.dim == dim]
    if not along:
        rule = positional(node, bc, lambda i, a, td: td, run=_cat_run)
        _check_unframed_args(node, bc, rule.frame)
        return rule
    # concatenation along time: piece i covers output steps [off_i, off_i + len_i); pieces without
    # time along ``dim`` after the last step (an attention sink's logit after a row of keys) are
    # the time dim's tail, whole in every window
    if any(not t.pure(meta_shape(p)[dim]) for p in pieces for t in bc.frame(p) if t.dim == dim):
        raise node_error(node, "concatenates along a dim where time is merged with another dim", _INSTEAD)
    timed = [any(t.dim == dim for t in bc.frame(p)) for p in pieces]
    n_steps = sum(meta_shape(p)[dim] for p, on in zip(pieces, timed) if on)
    first_fixed = timed.index(False) if False in timed else len(timed)
    if any(timed[first_fixed:]):
        raise node_error(node, f"concatenates a piece `{pieces[first_fixed].name}` that does not run along "
                         "time before pieces that do (pieces without time may only follow the last step)",
                         "concatenate it after the keys (torch.cat([scores, sink], -1), then drop it with "
                         "[..., :-1]), or use plan='none'")
    others = _frame_from(t for p in pieces for t in bc.frame(p) if t.dim != dim)
    frame = _frame_from([TDim(dim, n_steps, tail=out[dim] - n_steps), *others])
    maps: list[Any] = []
    off = 0
    for p, on in zip(pieces, timed):
        n = meta_shape(p)[dim]
        row = []
        for t in bc.frame(p):
            if t.dim == dim:
                row.append(DimMap("shift", _index_of(frame, dim), -off, length=n))
            else:
                row.append(DimMap("same", _index_of(frame, t.dim)))
        maps.append(tuple(row) if row else None)
        off += n
    _check_unframed_args(node, bc, frame)
    return NodeRule(frame, tuple(maps), _cat_run, note="cat along time" + (" and its tail" if frame[0].tail else ""))


def _pad_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    rule = ev.program.rules[node.name]
    x = vals[0]
    pads = list(node.args[1])
    nd = x.dim()
    # constant_pad_nd(x, pad, value) / pad(x, pad, mode, value)
    value = _arg(node, 3 if node.target is aten.pad.default else 2, "value", 0.0)
    for t, (lo, hi), m in zip(rule.frame, demand, rule.slots[0]):
        k = nd - 1 - t.dim
        if m.kind != "shift" or 2 * k >= len(pads):
            continue
        left = pads[2 * k]
        got_lo, got_hi = arg_demands[0][rule.slots[0].index(m)]
        pads[2 * k] = got_lo - (lo - left)
        pads[2 * k + 1] = (hi - left) - got_hi
    return aten.constant_pad_nd.default(x, pads, value if value is not None else 0.0)


@register_chunk_rule(aten.constant_pad_nd, aten.pad)
def _pad_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    if node.target is aten.pad.default and _arg(node, 2, "mode", "constant") != "constant":
        raise node_error(node, "reflect/replicate padding along time mirrors future steps", _INSTEAD)
    pads = list(node.args[1])
    shp = meta_shape(src)
    nd = len(shp)
    fr = bc.frame(src)
    out = meta_shape(node)
    tdims, maps = [], []
    for t in fr:
        k = nd - 1 - t.dim
        if 2 * k < len(pads) and (pads[2 * k] or pads[2 * k + 1]):
            if not t.pure(shp[t.dim]):
                raise node_error(node, "pads a dim where time is merged with another dim", _INSTEAD)
            tdims.append(TDim(t.dim, out[t.dim]))
        else:
            tdims.append(t)
    frame = _frame_from(tdims)
    for t in fr:
        k = nd - 1 - t.dim
        if 2 * k < len(pads) and (pads[2 * k] or pads[2 * k + 1]):
            maps.append(DimMap("shift", _index_of(frame, t.dim), -pads[2 * k], length=t.length))
        else:
            maps.append(DimMap("same", _index_of(frame, t.dim)))
    slots = [tuple(maps) if i == 0 else None for i, _ in enumerate(slots_of(node))]
    return NodeRule(frame, tuple(slots), _pad_run)


# --------------------------------------------------------------------------- factories


def _factory_frame(node: fx.Node, bc: BuildCtx) -> Frame:
    if node.name in bc.overrides:
        return bc.overrides[node.name]
    shp = meta_shape(node)
    tdims = bc.tl[node].time_dims if node.name in bc.tl.info else ()
    return _frame_from(TDim(d, shp[d]) for d in tdims)


def _factory_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    rule = ev.program.rules[node.name]
    shape = _new_shape(node, rule.frame, demand)
    t = node.target
    if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        args = list(node.args)
        if t is aten.arange.default:
            start, end, step = 0, args[0], 1
        else:
            start, end = args[0], args[1]
            step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
        if rule.frame:
            lo, hi = demand[0]
            start, end = start + lo * step, start + hi * step
        kw = {k: v for k, v in node.kwargs.items() if k != "step"}
        return torch.arange(start, end, step, **kw)
    val = node.meta["val"]
    kw = {"dtype": val.dtype, "device": val.device}
    if t in (aten.full.default, aten.new_full.default):
        fill = node.args[1] if t is aten.full.default else node.args[2]
        return torch.full(shape, fill, **kw)
    if t in (aten.zeros.default, aten.new_zeros.default):
        return torch.zeros(shape, **kw)
    if t in (aten.ones.default, aten.new_ones.default):
        return torch.ones(shape, **kw)
    return torch.empty(shape, **kw)


@register_chunk_rule(aten.arange, aten.full, aten.zeros, aten.ones, aten.empty, aten.new_full,
                     aten.new_zeros, aten.new_ones, aten.new_empty, aten.scalar_tensor)
def _factory_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    frame = _factory_frame(node, bc)
    if node.target is aten.scalar_tensor.default:
        return NodeRule((), tuple(None for _ in slots_of(node)), default_run)
    slots = tuple(SKIP for _ in slots_of(node))
    return NodeRule(frame, slots, _factory_run, note="factory")


_factory_rule.factory = True  # type: ignore[attr-defined]  # runs even when no input has time


def _triu_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    rule = ev.program.rules[node.name]
    x = vals[0]
    nd = x.dim()
    diag = _arg(node, 1, "diagonal", 0)
    lows = {t.dim: lo for t, (lo, hi) in zip(rule.frame, demand)}
    diag = diag + lows.get(nd - 2, 0) - lows.get(nd - 1, 0)
    return node.target(x, diag)


@register_chunk_rule(aten.triu, aten.tril)
def _triu_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    shp = meta_shape(node)
    for t in bc.frame(node.args[0]):
        if t.dim >= len(shp) - 2 and not t.pure(shp[t.dim]):
            raise node_error(node, "triu/tril on a merged time dim", _INSTEAD)
    return positional(node, bc, lambda i, a, td: td, run=_triu_run)




@register_chunk_rule(aten.topk, aten.sort, aten.argsort)
def _select_along_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """Selection along one dim (top-k, sort): local when that dim is not time (a router picking
    experts per token), refused along time (it compares steps with later ones)."""
    src = node.args[0]
    nd = len(meta_shape(src))
    default = -1
    dim = _norm(_arg(node, 2 if node.target is aten.topk.default else 1, "dim", default), nd)
    if any(t.dim == dim for t in bc.frame(src)):
        raise node_error(node, f"{op_name(node)} compares steps along the time axis (reads future steps)", _INSTEAD)
    rule = positional(node, bc, lambda i, a, td: td)
    if isinstance(node.meta.get("val"), (tuple, list)):
        rule.elem_frames = tuple(rule.frame for _ in node.meta["val"])
    return rule


@register_chunk_rule(aten.stack)
def _stack_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """``stack`` of pieces that all run along time on the same dims: a new non-time dim is
    inserted, each time dim moves past it. A stack that *makes* the time axis (loop steps
    stacked back together) is refused here: it cannot run one chunk at a time."""
    out = meta_shape(node)
    dim = _norm(_arg(node, 1, "dim", 0), len(out))
    pieces = [p for p in node.args[0] if isinstance(p, fx.Node)]
    frames = [bc.frame(p) for p in pieces]
    if not frames or any(f != frames[0] for f in frames) or not frames[0]:
        raise node_error(node, "stacks pieces that do not all run along time the same way (loop steps "
                         "stacked into a time axis, or time next to steps)", _INSTEAD)
    return positional(node, bc, lambda i, a, td: replace(td, dim=td.dim + (td.dim >= dim)), run=_cat_run_stack)


def _cat_run_stack(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    args, kwargs = rebuild_args(node, vals)
    return torch.stack(list(args[0]), *args[1:], **kwargs)
