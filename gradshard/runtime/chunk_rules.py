"""Chunk rules: how each aten op of a captured graph runs on a window of time steps.

A rule is built once per node at compile time (:func:`build_rule`) from the frames of
the node's inputs. It fixes the node's output :data:`~gradshard.runtime.chunk_frames.Frame`,
one :class:`~gradshard.runtime.chunk_frames.DimMap` per time dim of every tensor argument
(which window of the argument the node reads for a given output window) and a ``run``
function that executes the op on windowed values, rewriting what the captured graph baked
in for the full length ``T``: view shapes, factory sizes, ``arange`` offsets, ``triu``
diagonals, pads of convolutions, carries of scans.

Example: the captured ``view(linear, [B, T, H, D])`` for a chunk of ``w`` steps runs as
``reshape(linear_w, [B, w, H, D])``; ``arange(T)`` for window ``(s, s + w)`` runs as
``arange(s, s + w)``; ``triu(full([T, T], -inf), 1)`` for rows ``(s, e)`` and key columns
``(0, e)`` runs as ``triu(full([e - s, e], -inf), 1 + s)``.

Rules never guess: an op whose time behaviour is unknown, or that reads the future
(non-causal attention, reverse scans, flips along time), raises an error naming the node.
New ops plug in with :func:`register_chunk_rule`.
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx

from gradshard.errors import node_error
from gradshard.runtime.chunk_frames import SKIP, Demand, DimMap, Frame, TDim

aten = torch.ops.aten

__all__ = [
    "NodeRule", "BuildCtx", "AttentionSource", "build_rule", "register_chunk_rule", "CHUNK_RULES",
    "slots_of", "meta_shape", "default_run", "missing_frame_error", "reshape_time",
]

RunFn = Callable[[fx.Node, list, Demand, list, Any], Any]
_INSTEAD = ("use plan='none' (plain autograd) for this model, or rewrite the line so that "
            "step t reads only steps <= t")


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class AttentionSource:
    """Where an attention node's keys/values come from before any GQA head repeat."""

    k: str
    v: str
    n_rep: int  # key head h is source head h // n_rep


@dataclass
class NodeRule:
    """How one node runs on a window (see module doc).

    ``slots`` has one entry per ``fx.Node`` occurrence in ``(args, kwargs)`` (``map_arg``
    order): a tuple of :class:`DimMap` (one per time dim of that argument), ``None`` for
    an argument without time, or ``SKIP`` (not evaluated; ``run`` fetches what it needs).
    ``kind``: ``local``, ``mixer`` (reads all of the past: attention, contractions and
    reductions over keys), ``scan`` (a recurrence carried across chunks), ``global``
    (a reduction over the whole sequence: only allowed as a top-level loss), ``input``.
    """

    frame: Frame
    slots: tuple[Any, ...]
    run: RunFn
    kind: str = "local"
    elem_frames: tuple[Frame, ...] | None = None
    note: str = ""

    @property
    def mixer(self) -> bool:
        return self.kind in ("mixer", "scan")


@dataclass
class BuildCtx:
    """What rule builders may read: frames of earlier nodes, the time analysis, attention sources."""

    frames: dict[str, Frame]
    elem_frames: dict[str, tuple[Frame, ...]]
    tl: Any
    attention: dict[str, AttentionSource] = field(default_factory=dict)
    # (node, argument, the frame the argument should have): constants the time analysis did
    # not tie to time (an SDPA mask, a loss target); the planner backfills their sources
    missing: list[tuple[fx.Node, fx.Node, Frame]] = field(default_factory=list)
    overrides: dict[str, Frame] = field(default_factory=dict)  # backfilled frames of sources

    def frame(self, arg: Any) -> Frame:
        if not isinstance(arg, fx.Node):
            return ()
        return self.frames.get(arg.name, ())


Builder = Callable[[fx.Node, BuildCtx], NodeRule]
CHUNK_RULES: dict[Any, Builder] = {}


def register_chunk_rule(*ops: Any) -> Callable[[Builder], Builder]:
    """Register a rule builder for aten op packets (or callables such as ``operator.getitem``)."""

    def deco(fn: Builder) -> Builder:
        for op in ops:
            CHUNK_RULES[op] = fn
        return fn

    return deco


# --------------------------------------------------------------------------- helpers


def meta_shape(node: Any) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    return ()


def slots_of(node: fx.Node) -> list[fx.Node]:
    """Every ``fx.Node`` occurrence in ``(args, kwargs)``, in ``map_arg`` order."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a))
    return found


def _compile_builder(node: fx.Node) -> Callable[[Sequence[Any]], tuple[tuple, dict]]:
    """A fast ``vals -> (args, kwargs)`` for ``node`` (slot order as :func:`slots_of`)."""
    k = 0

    def spec_of(a: Any) -> tuple[int, Any] | None:
        nonlocal k
        if isinstance(a, fx.Node):
            k += 1
            return (0, k - 1)
        if isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
            items = []
            for x in a:
                if isinstance(x, (list, tuple, dict)) and any(isinstance(y, fx.Node) for y in x):
                    return None
                items.append(spec_of(x) if isinstance(x, fx.Node) else (1, x))
            return (2, (isinstance(a, tuple), items))
        if isinstance(a, dict) and any(isinstance(x, fx.Node) for x in a.values()):
            return None
        return (1, a)

    arg_spec = [spec_of(a) for a in node.args]
    kw_spec = {n: spec_of(a) for n, a in node.kwargs.items()}
    if any(x is None for x in arg_spec) or any(x is None for x in kw_spec.values()):
        def slow(vals: Sequence[Any]) -> tuple[tuple, dict]:
            it = iter(vals)
            return fx.node.map_arg((node.args, node.kwargs), lambda a: next(it))
        return slow

    def fill(spec: tuple[int, Any], vals: Sequence[Any]) -> Any:
        t, v = spec
        if t == 0:
            return vals[v]
        if t == 1:
            return v
        is_tuple, items = v
        seq = [vals[i] if kind == 0 else i for kind, i in items]
        return tuple(seq) if is_tuple else seq

    def build(vals: Sequence[Any]) -> tuple[tuple, dict]:
        return tuple(fill(s, vals) for s in arg_spec), {n: fill(s, vals) for n, s in kw_spec.items()}

    return build


_BUILDERS: "weakref.WeakKeyDictionary[fx.Node, Callable]" = weakref.WeakKeyDictionary()


def rebuild_args(node: fx.Node, vals: Sequence[Any]) -> tuple[tuple, dict]:
    """``node``'s ``(args, kwargs)`` with its input nodes replaced by ``vals`` (slot order)."""
    build = _BUILDERS.get(node)
    if build is None:
        build = _BUILDERS[node] = _compile_builder(node)
    return build(vals)


def default_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    args, kwargs = rebuild_args(node, vals)
    return node.target(*args, **kwargs)


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _norm(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


def _opname(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _frame_from(tdims: Iterable[TDim]) -> Frame:
    by_dim: dict[int, TDim] = {}
    for t in tdims:
        old = by_dim.get(t.dim)
        if old is not None and (old.length, old.inner) != (t.length, t.inner):
            raise ValueError(f"dim {t.dim} carries two different time axes ({old} vs {t})")
        by_dim[t.dim] = t
    return tuple(by_dim[d] for d in sorted(by_dim))


def _index_of(frame: Frame, dim: int) -> int:
    for k, t in enumerate(frame):
        if t.dim == dim:
            return k
    raise KeyError(dim)


def positional(node: fx.Node, bc: BuildCtx, mapper: Callable[[int, fx.Node, TDim], TDim | None],
               run: RunFn = default_run, kind: str = "local", extra: Iterable[TDim] = ()) -> NodeRule:
    """A rule where each argument time dim lands on one output dim (``mapper`` says which).

    ``mapper(slot, arg, tdim)`` returns the output :class:`TDim` or ``None`` (then the node
    does not keep that time dim: an error, the caller handles reductions itself).
    """
    slots = slots_of(node)
    mapped: list[list[TDim]] = []
    outs: list[TDim] = list(extra)
    for i, a in enumerate(slots):
        row: list[TDim] = []
        for td in bc.frame(a):
            out = mapper(i, a, td)
            if out is None:
                raise node_error(node, f"{_opname(node)} removes the time axis of `{a.name}` in a way "
                                 "gradshard cannot split into chunks", _INSTEAD)
            row.append(out)
            outs.append(out)
        mapped.append(row)
    try:
        frame = _frame_from(outs)
    except ValueError as exc:
        raise node_error(node, f"{_opname(node)} combines time axes that do not line up: {exc}", _INSTEAD) from exc
    maps: list[Any] = []
    for a, row in zip(slots, mapped):
        if not bc.frame(a):
            maps.append(None)
        else:
            maps.append(tuple(DimMap("same", _index_of(frame, t.dim)) for t in row))
    return NodeRule(frame, tuple(maps), run, kind)


def _check_unframed_args(node: fx.Node, bc: BuildCtx, frame: Frame) -> None:
    """A tensor argument without time but with a dim of size T aligned to a time dim must be
    sliced too: record it in ``bc.missing`` (the planner backfills its frame, or fails)."""
    out = meta_shape(node)
    for a in slots_of(node):
        if bc.frame(a):
            continue
        shp = meta_shape(a)
        off = len(out) - len(shp)
        want = [TDim(t.dim - off, t.length, t.inner) for t in frame
                if 0 <= t.dim - off < len(shp) and shp[t.dim - off] == out[t.dim] and out[t.dim] > 1]
        if want:
            bc.missing.append((node, a, tuple(want)))


def missing_frame_error(node: fx.Node, arg: fx.Node) -> Exception:
    return node_error(node, f"argument `{arg.name}` has a dim of the sequence length that gradshard "
                      "cannot slice (it does not come from an input, a buffer or a constant built in "
                      "the model from shapes)", "register the tensor as a buffer of the module "
                      "(register_buffer) or build it inside forward")


# --------------------------------------------------------------------------- pointwise


def _broadcast_mapper(node: fx.Node) -> Callable[[int, fx.Node, TDim], TDim | None]:
    out = meta_shape(node)

    def mapper(i: int, a: fx.Node, td: TDim) -> TDim | None:
        shp = meta_shape(a)
        j = td.dim + len(out) - len(shp)
        if j < 0 or j >= len(out) or out[j] != shp[td.dim]:
            return None
        return TDim(j, td.length, td.inner)

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
    aten.bitwise_xor, aten.logaddexp, aten.atan2, aten.hypot, aten.xlogy, aten.log_sigmoid,
]
register_chunk_rule(*_POINTWISE)(pointwise_rule)


@register_chunk_rule(aten.dropout, aten.native_dropout, aten.feature_dropout, aten.bernoulli,
                     aten.rand_like, aten.randn_like, aten.rand, aten.randn, aten.randint, aten.normal,
                     aten.uniform, aten.randperm, aten.multinomial)
def _random_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    if node.target in (aten.dropout.default, aten.feature_dropout.default):
        p, train = _arg(node, 1, "p", 0.0), _arg(node, 2, "train", False)
        if p == 0 or not train:
            return pointwise_rule(node, bc)
    raise node_error(node, f"{_opname(node)} draws random numbers: the chunked backward recomputes "
                     "the forward, which would draw different numbers and give a wrong gradient",
                     "disable dropout/noise for chunked training (model.eval() or p=0), or use "
                     "plan='none'")


# --------------------------------------------------------------------------- views


def reshape_time(in_shape: Sequence[int], out_shape: Sequence[int], td: TDim) -> TDim | None:
    """Where the time digit of ``td`` lands in a row-major reshape (None: it is split)."""
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
        return TDim(inverse[td.dim], td.length, td.inner)

    return mapper


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
    return positional(node, bc, _broadcast_mapper(node), run=_expand_run)


@register_chunk_rule(aten.repeat)
def _repeat_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    reps = list(node.args[1])
    out = meta_shape(node)

    def mapper(i: int, a: fx.Node, td: TDim) -> TDim | None:
        j = td.dim + len(out) - len(meta_shape(a))
        return TDim(j, td.length, td.inner) if reps[j] == 1 else None

    return positional(node, bc, mapper)


@register_chunk_rule(aten.repeat_interleave)
def _repeat_interleave_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    dim = _arg(node, 2, "dim")
    src = node.args[0]
    if dim is None or not isinstance(src, fx.Node):
        raise node_error(node, "repeat_interleave without a dim flattens the tensor", _INSTEAD)
    d = _norm(dim, len(meta_shape(src)))
    if any(t.dim == d for t in bc.frame(src)) or isinstance(_arg(node, 1, "repeats"), fx.Node):
        raise node_error(node, "repeat_interleave along the time axis", _INSTEAD)
    return positional(node, bc, lambda i, a, td: td if i == 0 else None)


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
    if not t.pure(meta_shape(src)[dim]):
        raise node_error(node, "slices a dim in which time is merged with another dim", _INSTEAD)
    if step != 1:
        raise node_error(node, f"takes every {step}-th step along time", _INSTEAD)
    out_len = meta_shape(node)[dim]
    frame = _frame_from([TDim(dim, out_len)] + [x for x in fr if x.dim != dim])
    maps = tuple(DimMap("shift", _index_of(frame, dim), start, length=t.length) if x.dim == dim
                 else DimMap("same", _index_of(frame, x.dim)) for x in fr)
    return NodeRule(frame, (maps,), _identity_run, note=f"shift {start}")


@register_chunk_rule(aten.select)
def _select_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    dim = _norm(node.args[1], len(meta_shape(src)))
    if any(t.dim == dim for t in bc.frame(src)):
        raise node_error(node, "selects one time step (a per-step Python loop or x[:, i]); chunked "
                         "plans run the model on windows of steps", "vectorise the loop (cumsum, "
                         "gradshard.kernels.linear_scan) or use plan='none'")
    return positional(node, bc, lambda i, a, td: TDim(td.dim - (td.dim > dim), td.length, td.inner))


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
            return TDim(td.dim if td.dim < p else td.dim + ni - 1, td.length, td.inner)
        return TDim(p + td.dim, td.length, td.inner)

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
        return positional(node, bc, lambda i, a, td: td if a is src else TDim(dim, td.length, td.inner))
    return positional(node, bc, lambda i, a, td: td)


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
    # concatenation along time: piece i covers output steps [off_i, off_i + len_i)
    if any(not t.pure(meta_shape(p)[dim]) for p in pieces for t in bc.frame(p) if t.dim == dim):
        raise node_error(node, "concatenates along a dim where time is merged with another dim", _INSTEAD)
    others = _frame_from(t for p in pieces for t in bc.frame(p) if t.dim != dim)
    frame = _frame_from([TDim(dim, out[dim]), *others])
    maps: list[Any] = []
    off = 0
    for p in pieces:
        n = meta_shape(p)[dim]
        row = []
        pf = bc.frame(p)
        if not any(t.dim == dim for t in pf):
            raise node_error(node, f"concatenates a piece `{p.name}` that does not run along time "
                             "with pieces that do", _INSTEAD)
        for t in pf:
            if t.dim == dim:
                row.append(DimMap("shift", _index_of(frame, dim), -off, length=n))
            else:
                row.append(DimMap("same", _index_of(frame, t.dim)))
        maps.append(tuple(row))
        off += n
    return NodeRule(frame, tuple(maps), _cat_run, note="cat along time")


def _pad_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    rule = ev.program.rules[node.name]
    x = vals[0]
    pads = list(node.args[1])
    nd = x.dim()
    value = _arg(node, 2, "value", 0.0)
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


# --------------------------------------------------------------------------- contractions


def _check_causal_mixer(node: fx.Node, bc: BuildCtx, what: str) -> None:
    info = bc.tl.info.get(node.name)
    local = info.local if info is not None else None
    if local is None or not (local.lo == -math.inf and local.hi <= 0):
        raise node_error(node, f"{what} reads future steps (non-causal attention: no causal mask, "
                         "or one gradshard cannot verify)", "mask the scores causally (is_causal=True or "
                         "a causal mask built in the model), or use plan='none'")


def _matmul_like(node: fx.Node, bc: BuildCtx, a: fx.Node, b: fx.Node, bias: Any = None) -> NodeRule:
    out = meta_shape(node)
    nd = len(out)
    sa, sb = meta_shape(a), meta_shape(b)
    if len(sa) < 2 or len(sb) < 2:
        raise node_error(node, "matrix-vector products along time are not supported", _INSTEAD)
    outs: list[TDim] = []
    row_a: list[tuple[TDim, Any]] = []
    row_b: list[tuple[TDim, Any]] = []
    contracted = False
    for td in bc.frame(a):
        if td.dim == len(sa) - 1:
            row_a.append((td, "contract"))
            contracted = True
        elif td.dim == len(sa) - 2:
            t = TDim(nd - 2, td.length, td.inner)
            outs.append(t)
            row_a.append((td, t.dim))
        else:
            t = TDim(td.dim + nd - len(sa), td.length, td.inner)
            outs.append(t)
            row_a.append((td, t.dim))
    for td in bc.frame(b):
        if td.dim == len(sb) - 2:
            row_b.append((td, "contract"))
            contracted = True
        elif td.dim == len(sb) - 1:
            t = TDim(nd - 1, td.length, td.inner)
            outs.append(t)
            row_b.append((td, t.dim))
        else:
            t = TDim(td.dim + nd - len(sb), td.length, td.inner)
            outs.append(t)
            row_b.append((td, t.dim))
    frame = _frame_from(outs)
    if contracted:
        _check_causal_mixer(node, bc, f"the product `{node.name}` contracts the time axis and")
        if len(frame) != 1:
            raise node_error(node, "contracts time but keeps no query time axis", _INSTEAD)
        if not bc.tl.info[a.name].causal_mask:
            raise node_error(node, "contracts time with a score matrix that is not causally masked", _INSTEAD)

    def maps_for(row: list[tuple[TDim, Any]]) -> tuple[DimMap, ...] | None:
        if not row:
            return None
        return tuple(DimMap("prefix", 0) if where == "contract" else DimMap("same", _index_of(frame, where))
                     for _, where in row)

    slot_maps: list[Any] = []
    for s in slots_of(node):
        if s is a:
            slot_maps.append(maps_for(row_a))
        elif s is b:
            slot_maps.append(maps_for(row_b))
        elif s is bias:
            bf = bc.frame(s)
            sh = meta_shape(s)
            slot_maps.append(tuple(DimMap("same", _index_of(frame, t.dim + nd - len(sh))) for t in bf) or None)
        else:
            slot_maps.append(None)
    return NodeRule(frame, tuple(slot_maps), default_run, kind="mixer" if contracted else "local",
                    note="causal contraction over time" if contracted else "")


@register_chunk_rule(aten.matmul, aten.bmm, aten.mm)
def _matmul_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    a, b = node.args[0], node.args[1]
    if a is b:
        raise node_error(node, "multiplies a tensor with itself", _INSTEAD)
    return _matmul_like(node, bc, a, b)


@register_chunk_rule(aten.addmm, aten.baddbmm)
def _addmm_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    return _matmul_like(node, bc, node.args[1], node.args[2], bias=node.args[0])


@register_chunk_rule(aten.linear)
def _linear_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    x = node.args[0]
    if any(bc.frame(w) for w in node.args[1:]):
        raise node_error(node, "the weight of a linear layer runs along time", _INSTEAD)
    if any(t.dim == len(meta_shape(x)) - 1 for t in bc.frame(x)):
        raise node_error(node, "a linear layer mixes the time axis", _INSTEAD)
    return positional(node, bc, lambda i, a, td: td)


def _einsum_letters(spec: str, nd: int) -> list[str]:
    if "..." in spec:
        pre, post = spec.split("...")
        return list(pre) + [f"_{i}" for i in range(nd - len(pre) - len(post))] + list(post)
    return list(spec)


@register_chunk_rule(aten.einsum)
def _einsum_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    eq = node.args[0].replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    operands = list(node.args[1])
    specs = lhs.split(",")
    out = meta_shape(node)
    if not rhs:
        raise node_error(node, "einsum without an explicit output", "write the '->' part of the equation")
    out_letters = _einsum_letters(rhs, len(out))
    letter_t: dict[str, TDim] = {}
    for spec, op in zip(specs, operands):
        letters = _einsum_letters(spec, len(meta_shape(op)))
        for td in bc.frame(op):
            letter_t[letters[td.dim]] = td
    outs = [TDim(out_letters.index(l), t.length, t.inner) for l, t in letter_t.items() if l in out_letters]
    frame = _frame_from(outs)
    contracted = [l for l in letter_t if l not in out_letters]
    if contracted:
        _check_causal_mixer(node, bc, f"the einsum `{node.name}` contracts the time axis and")
        if len(frame) != 1:
            raise node_error(node, "contracts time but keeps no query time axis", _INSTEAD)
    slot_maps = []
    for s in slots_of(node):
        letters = _einsum_letters(specs[operands.index(s)], len(meta_shape(s)))
        maps = []
        for td in bc.frame(s):
            l = letters[td.dim]
            maps.append(DimMap("prefix", 0) if l in contracted else DimMap("same", _index_of(frame, out_letters.index(l))))
        slot_maps.append(tuple(maps) or None)
    return NodeRule(frame, tuple(slot_maps), default_run, kind="mixer" if contracted else "local")


# --------------------------------------------------------------------------- reductions


def _reduced_dims(node: fx.Node, nd: int) -> tuple[list[int] | None, bool]:
    t = node.target
    if t in (aten.norm.ScalarOpt_dim, aten.linalg_vector_norm.default):
        dims = _arg(node, 2, "dim")
        keep = _arg(node, 3, "keepdim", False)
    elif t in (aten.sum.default, aten.mean.default, aten.amax.default, aten.amin.default) and len(node.args) < 2:
        dims, keep = None, False
    else:
        dims = _arg(node, 1, "dim")
        keep = _arg(node, 2, "keepdim", False)
    if isinstance(dims, int):
        dims = [dims]
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return None, bool(keep)
    return [_norm(d, nd) for d in dims], bool(keep)


def reduction_over_time(node: fx.Node, bc: BuildCtx) -> tuple[bool, list[int]]:
    """(reduces a time dim?, reduced dims) for a reduction node."""
    src = node.args[0]
    nd = len(meta_shape(src))
    dims, keep = _reduced_dims(node, nd)
    red = list(range(nd)) if dims is None else dims
    return any(t.dim in red for t in bc.frame(src)), red


@register_chunk_rule(aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.prod,
                     aten.var, aten.std, aten.norm, aten.linalg_vector_norm, aten.logsumexp,
                     aten.any, aten.all, aten.argmax, aten.argmin, aten.var_mean, aten.std_mean)
def _reduce_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    shp = meta_shape(src)
    nd = len(shp)
    dims, keep = _reduced_dims(node, nd)
    if node.target in (aten.max.default, aten.min.default):
        dims = None
    red = set(range(nd)) if dims is None else set(dims)
    fr = bc.frame(src)
    time_red = [t for t in fr if t.dim in red]
    kept = [t for t in fr if t.dim not in red]

    def out_dim(d: int) -> int:
        return d if keep else d - sum(1 for r in red if r < d)

    multi = isinstance(node.meta.get("val"), (tuple, list))
    if time_red and not kept:
        return NodeRule((), (None,) * len(slots_of(node)), default_run, kind="global",
                        note="reduces over the whole sequence")
    if not time_red:
        rule = positional(node, bc, lambda i, a, td: TDim(out_dim(td.dim), td.length, td.inner))
        if multi:
            rule.elem_frames = tuple(rule.frame for _ in node.meta["val"])
        return rule
    # a reduction over the key axis of a score matrix (manual softmax / attention pooling)
    if len(kept) != 1 or len(time_red) != 1 or not bc.tl.info[src.name].causal_mask:
        raise node_error(node, "reduces over the time axis inside the model (reads future steps)", _INSTEAD)
    frame = (TDim(out_dim(kept[0].dim), kept[0].length, kept[0].inner),)
    maps = tuple(DimMap("prefix", 0) if t in time_red else DimMap("same", 0) for t in fr)
    slots = tuple(maps if s is src else None for s in slots_of(node))
    rule = NodeRule(frame, slots, default_run, kind="mixer", note="reduction over causal keys")
    if multi:
        rule.elem_frames = tuple(frame for _ in node.meta["val"])
    return rule


def _softmax_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    rule = ev.program.rules[node.name]
    d = _norm(node.args[1], vals[0].dim())
    k = _index_of(rule.frame, d)
    other = [w for j, w in enumerate(demand) if j != k]
    if demand[k][0] != 0 or (other and demand[k][1] != other[0][1]):
        raise RuntimeError(f"gradshard internal: softmax `{node.name}` asked for keys {demand[k]} "
                           f"with queries {other}; keys must be the causal prefix")
    return default_run(node, vals, demand, arg_demands, ev)


@register_chunk_rule(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax)
def _softmax_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    d = _norm(node.args[1], len(meta_shape(src)))
    fr = bc.frame(src)
    if not any(t.dim == d for t in fr):
        return positional(node, bc, lambda i, a, td: td)
    if len(fr) != 2 or not bc.tl.info[src.name].causal_mask:
        raise node_error(node, "normalises over the time axis without a causal mask (reads future steps)",
                         "mask the scores causally before the softmax, or use plan='none'")
    return positional(node, bc, lambda i, a, td: td, run=_softmax_run)


@register_chunk_rule(aten.layer_norm, aten.rms_norm, aten.native_layer_norm)
def _norm_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    nd = len(meta_shape(src))
    k = len(node.args[1])
    if any(t.dim >= nd - k for t in bc.frame(src)) or any(bc.frame(w) for w in slots_of(node)[1:]):
        raise node_error(node, "normalises over the time axis (reads future steps)", _INSTEAD)
    rule = positional(node, bc, lambda i, a, td: td)
    if isinstance(node.meta.get("val"), (tuple, list)):
        rule.elem_frames = tuple(rule.frame for _ in node.meta["val"])
    return rule


@register_chunk_rule(aten.group_norm, aten.native_group_norm, aten.batch_norm, aten.native_batch_norm,
                     aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
                     aten.instance_norm)
def _batch_norm_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    raise node_error(node, f"{_opname(node)} normalises over the time axis (statistics over all steps)",
                     "use LayerNorm/RMSNorm over features, or plan='none'")


@register_chunk_rule(aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd)
def _loss_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    reduction = _arg(node, 3, "reduction", 1)
    x, target = node.args[0], node.args[1]
    if any(t.dim == 1 for t in bc.frame(x)) and len(meta_shape(x)) > 1:
        raise node_error(node, "the class dim of the loss runs along time", _INSTEAD)
    rows = [t for t in bc.frame(x) if t.dim == 0]
    if isinstance(target, fx.Node) and rows and not bc.frame(target) and meta_shape(target) \
            and meta_shape(target)[0] == meta_shape(x)[0]:
        bc.missing.append((node, target, (rows[0],)))
    if reduction != 0:
        return NodeRule((), (None,) * len(slots_of(node)), default_run, kind="global",
                        note="loss over the whole sequence")

    def mapper(i: int, a: fx.Node, td: TDim) -> TDim | None:
        if a is x and len(meta_shape(x)) > 1:
            return TDim(td.dim if td.dim == 0 else td.dim - 1, td.length, td.inner)
        return td

    return positional(node, bc, mapper)


# --------------------------------------------------------------------------- scans


_COMBINE = {
    aten.cumsum.default: torch.add,
    aten.cumprod.default: torch.mul,
    aten.logcumsumexp.default: torch.logaddexp,
}


def _scan_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    rule = ev.program.rules[node.name]
    k = 0
    lo, hi = demand[k]
    if lo > ev.start:  # a window starting inside the chunk: compute from the chunk start
        full = ev.value(node, tuple((ev.start, h) if j == k else w for j, w in enumerate(demand)))
        return full.narrow(rule.frame[k].dim, lo - ev.start, hi - lo)
    out = default_run(node, vals, demand, arg_demands, ev)
    if lo == 0:
        return out
    carry = ev.value(node, tuple((lo - 1, lo) if j == k else w for j, w in enumerate(demand)))
    return _COMBINE[node.target](carry, out)


@register_chunk_rule(aten.cumsum, aten.cumprod, aten.logcumsumexp, aten.cummax, aten.cummin)
def _scan_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    shp = meta_shape(src)
    d = _norm(node.args[1], len(shp))
    fr = bc.frame(src)
    hit = [t for t in fr if t.dim == d]
    if not hit:
        rule = positional(node, bc, lambda i, a, td: td)
        if isinstance(node.meta.get("val"), (tuple, list)):
            rule.elem_frames = tuple(rule.frame for _ in node.meta["val"])
        return rule
    if node.target not in _COMBINE:
        raise node_error(node, f"{_opname(node)} along time (indices of the running extremum) is not "
                         "supported by chunked plans", "use cumsum/cumprod/logcumsumexp or plan='none'")
    if not hit[0].pure(shp[d]) or len(fr) != 1:
        raise node_error(node, "scans a dim where time is merged with another dim", _INSTEAD)
    rule = positional(node, bc, lambda i, a, td: td, run=_scan_run, kind="scan")
    rule.note = f"{_opname(node)} carried across chunks"
    return rule


def _linear_scan_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    lo, hi = demand[0]
    if lo > ev.start:
        full = ev.value(node, ((ev.start, hi),))
        return full.narrow(1, lo - ev.start, hi - lo)
    args, kwargs = rebuild_args(node, vals)
    args = list(args)
    while len(args) < 5:
        args.append({2: None, 3: False, 4: None}[len(args)])
    if lo > 0:
        args[2] = ev.value(node, ((lo - 1, lo),)).squeeze(1)
    return torch.ops.gradshard.linear_scan(*args, **kwargs)


def _linear_scan_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    reverse = _arg(node, 3, "reverse", False)
    if reverse:
        raise node_error(node, "a reverse scan reads future steps", _INSTEAD)
    u = node.args[1]
    fr = bc.frame(u)
    if len(fr) != 1 or fr[0].dim != 1 or not fr[0].pure(meta_shape(u)[1]):
        raise node_error(node, "linear_scan whose time axis gradshard cannot follow", _INSTEAD)
    h0 = _arg(node, 2, "h0")
    if isinstance(h0, fx.Node) and bc.frame(h0):
        raise node_error(node, "the initial state of a scan runs along time", _INSTEAD)
    rule = positional(node, bc, lambda i, a, td: td, run=_linear_scan_run, kind="scan")
    rule.note = "linear_scan carried across chunks"
    return rule


# --------------------------------------------------------------------------- attention


def _sdpa_general_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    args, kwargs = rebuild_args(node, vals)
    q, k, v = args[:3]
    mask = _arg_value(node, args, kwargs, 3, "attn_mask")
    is_causal = bool(_arg_value(node, args, kwargs, 5, "is_causal", False))
    lo, hi = demand[0]
    if is_causal:  # bottom-right aligned: query lo + i sees keys <= lo + i
        mask = torch.ones(hi - lo, hi, dtype=torch.bool, device=q.device).tril(lo)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False,
        scale=kwargs.get("scale"), enable_gqa=bool(kwargs.get("enable_gqa", False)))


def _arg_value(node: fx.Node, args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _sdpa_fast_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    from gradshard.runtime.chunk_attention import prefix_attention

    src: AttentionSource = ev.program.attention[node.name]
    q = vals[0]
    lo, hi = demand[0]
    nodes = ev.program.nodes
    k_node, v_node = nodes[src.k], nodes[src.v]
    k_cur, v_cur = ev.value(k_node, ((lo, hi),)), ev.value(v_node, ((lo, hi),))
    k_past = v_past = None
    if lo > 0:
        k_past, v_past = ev.value(k_node, ((0, lo),)), ev.value(v_node, ((0, lo),))
    return prefix_attention(q, k_past, v_past, k_cur, v_cur, node.kwargs.get("scale"))


@register_chunk_rule(aten.scaled_dot_product_attention)
def _sdpa_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    q, k, v = node.args[:3]
    mask = _arg(node, 3, "attn_mask")
    dropout = _arg(node, 4, "dropout_p", 0.0)
    is_causal = bool(_arg(node, 5, "is_causal", False))
    if dropout:
        raise node_error(node, "attention dropout draws random numbers; the recomputed forward would "
                         "draw different ones", "set dropout_p=0 for chunked training, or plan='none'")
    _check_causal_mixer(node, bc, "this attention")
    fq, fk, fv = bc.frame(q), bc.frame(k), bc.frame(v)
    nq, nk = len(meta_shape(q)), len(meta_shape(k))
    if len(fq) != 1 or fq[0].dim != nq - 2 or len(fk) != 1 or fk[0].dim != nk - 2 or len(fv) != 1:
        raise node_error(node, "attention whose query/key time axis is not the second-to-last dim", _INSTEAD)
    frame = (TDim(nq - 2, fq[0].length, fq[0].inner),)
    if isinstance(mask, fx.Node) and not bc.frame(mask):
        ms = meta_shape(mask)
        if len(ms) >= 2 and ms[-2] == fq[0].length and ms[-1] == fk[0].length:
            bc.missing.append((node, mask, (TDim(len(ms) - 2, fq[0].length), TDim(len(ms) - 1, fk[0].length))))
    src = bc.attention.get(node.name)
    fast = (src is not None and is_causal and mask is None and nq == 4
            and meta_shape(q)[-1] == meta_shape(v)[-1])
    slot_maps: list[Any] = []
    for s in slots_of(node):
        if s is q and not slot_maps:
            slot_maps.append((DimMap("same", 0),))
        elif s is mask:
            mf = bc.frame(s)
            ms = meta_shape(s)
            row = []
            for t in mf:
                j = t.dim + 4 - len(ms)
                row.append(DimMap("same", 0) if j == 2 else DimMap("prefix", 0))
            slot_maps.append(tuple(row) or None)
        elif fast:
            slot_maps.append(SKIP)
        else:
            slot_maps.append((DimMap("prefix", 0),))
    return NodeRule(frame, tuple(slot_maps), _sdpa_fast_run if fast else _sdpa_general_run,
                    kind="mixer", note="causal attention against the KV cache" + (" (flash, GQA)" if fast else ""))


# --------------------------------------------------------------------------- tuples


def _getitem_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    return vals[0][node.args[1]]


@register_chunk_rule(operator.getitem)
def _getitem_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src, i = node.args[0], node.args[1]
    elems = bc.elem_frames.get(src.name)
    frame = elems[i] if elems is not None and i < len(elems) else bc.frame(src)
    sf = bc.frame(src)
    if not sf:
        return NodeRule(frame, (None,), _getitem_run)
    if len(sf) != len(frame):
        raise node_error(node, "an element of a tuple with a different number of time axes", _INSTEAD)
    return NodeRule(frame, (tuple(DimMap("same", k) for k in range(len(sf))),), _getitem_run)


@register_chunk_rule(aten.split, aten.split_with_sizes, aten.unbind, aten.chunk, aten.tensor_split)
def _split_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    src = node.args[0]
    nd = len(meta_shape(src))
    dim = _norm(_arg(node, 1 if node.target is aten.unbind.int else 2, "dim", 0), nd)
    fr = bc.frame(src)
    if any(t.dim == dim for t in fr):
        raise node_error(node, "splits the time axis into pieces", _INSTEAD)
    removed = node.target is aten.unbind.int
    frame = tuple(TDim(t.dim - (removed and t.dim > dim), t.length, t.inner) for t in fr)
    maps = tuple(DimMap("same", k) for k in range(len(fr))) or None
    n = len(node.meta.get("val") or ())
    rule = NodeRule(frame, tuple(maps if s is src else None for s in slots_of(node)), default_run)
    rule.elem_frames = tuple(frame for _ in range(n))
    return rule


def _rolled_body_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """``run_rolled_body(body, *args)`` (a per-step loop rolled by ``roll_loops``): vmap over time."""
    body = getattr(node.graph.owning_module, node.args[0].target)
    args = node.args[1:]
    lengths = [meta_shape(a)[d] for a, d in zip(args, body.in_dims) if d is not None and isinstance(a, fx.Node)]
    if not lengths:
        raise node_error(node, "a rolled loop body without a time input", _INSTEAD)
    slot_maps: list[Any] = [None]
    for a, d in zip(args, body.in_dims):
        if not isinstance(a, fx.Node):
            continue
        fr = bc.frame(a)
        if d is None:
            if fr:
                raise node_error(node, f"loop-invariant input `{a.name}` of a rolled loop runs along time", _INSTEAD)
            slot_maps.append(None)
            continue
        if len(fr) != 1 or fr[0].dim != _norm(d, len(meta_shape(a))):
            raise node_error(node, f"input `{a.name}` of a rolled loop has a time axis gradshard cannot follow", _INSTEAD)
        slot_maps.append((DimMap("same", 0),))
    vals = node.meta.get("val") or ()
    elems = tuple((TDim(_norm(d, v.dim()), lengths[0]),) for d, v in zip(body.out_dims, vals))
    rule = NodeRule(elems[0] if elems else (), tuple(slot_maps), default_run, note="rolled loop body (per step)")
    rule.elem_frames = elems
    return rule


def _register_rolled_body() -> None:
    try:
        from gradshard.runtime.adjoint_loops import run_rolled_body
    except ImportError:  # the adjoint runtime is optional
        return
    CHUNK_RULES[run_rolled_body] = _rolled_body_rule


_register_rolled_body()


# --------------------------------------------------------------------------- convolution


def _conv_params(node: fx.Node) -> tuple[int, int, int, int]:
    if node.target is aten.conv1d.default or node.target is aten.conv1d.padding:
        stride, padding, dilation = _arg(node, 3, "stride", 1), _arg(node, 4, "padding", 0), _arg(node, 5, "dilation", 1)
    else:
        stride, padding, dilation = node.args[3], node.args[4], node.args[5]
        if node.args[6]:
            raise ValueError("transposed convolution")
    pick = lambda v: v[-1] if isinstance(v, (list, tuple)) else v  # noqa: E731
    k = meta_shape(node.args[1])[-1]
    if isinstance(padding, str):
        padding = 0 if padding == "valid" else None
    return pick(stride), pick(padding) if padding is not None else -1, pick(dilation), k


def _conv_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    rule = ev.program.rules[node.name]
    x = vals[0]
    _, padding, dilation, k = _conv_params(node)
    t = rule.frame[-1]
    lo, hi = demand[_index_of(rule.frame, t.dim)]
    got_lo, got_hi = arg_demands[0][-1]
    need_lo, need_hi = lo - padding, hi - padding + dilation * (k - 1)
    x = aten.constant_pad_nd.default(x, [got_lo - need_lo, need_hi - got_hi], 0.0)
    args, kwargs = rebuild_args(node, vals)
    args, kwargs = list(args), dict(kwargs)
    args[0] = x
    if node.target is aten.conv1d.default:
        while len(args) < 7:
            args.append({2: None, 3: [1], 4: [0], 5: [1], 6: 1}[len(args)])
        args[4] = [0]
        kwargs.pop("padding", None)
    else:
        args[4] = [0] * len(args[4]) if isinstance(args[4], (list, tuple)) else 0
    return node.target(*args, **kwargs)


@register_chunk_rule(aten.conv1d, aten.convolution)
def _conv_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    x = node.args[0]
    nd = len(meta_shape(x))
    fr = bc.frame(x)
    if any(bc.frame(a) for a in slots_of(node)[1:]):
        raise node_error(node, "convolution weights run along time", _INSTEAD)
    try:
        stride, padding, dilation, k = _conv_params(node)
    except ValueError as exc:
        raise node_error(node, f"{exc} along time", _INSTEAD) from exc
    along = [t for t in fr if t.dim == nd - 1]
    if not along:
        return positional(node, bc, lambda i, a, td: td)
    if nd != 3 or stride != 1 or padding < 0 or not along[0].pure(meta_shape(x)[-1]):
        raise node_error(node, "a convolution along time with stride, 'same' padding or more than "
                         "one spatial dim", "use a stride-1 Conv1d with integer padding, or plan='none'")
    out = meta_shape(node)
    frame = _frame_from([TDim(nd - 1, out[-1])] + [t for t in fr if t.dim != nd - 1])
    maps = []
    for t in fr:
        if t.dim == nd - 1:
            maps.append(DimMap("extend", _index_of(frame, t.dim), padding,
                               right=dilation * (k - 1) - padding, length=t.length))
        else:
            maps.append(DimMap("same", _index_of(frame, t.dim)))
    slots = tuple(tuple(maps) if i == 0 else None for i, _ in enumerate(slots_of(node)))
    return NodeRule(frame, slots, _conv_run, note=f"window of {dilation * (k - 1) + 1} steps")


# --------------------------------------------------------------------------- dispatch


def build_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """The :class:`NodeRule` of a ``call_function`` node (raises if its time use is unsafe)."""
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    builder = CHUNK_RULES.get(packet) if packet is not None else CHUNK_RULES.get(target)
    qual = getattr(packet, "_qualified_op_name", None)
    if builder is None and qual == "gradshard::linear_scan":
        builder = _linear_scan_rule
    has_time = any(bc.frame(a) for a in slots_of(node))
    if builder is None and packet is not None and torch.Tag.pointwise in getattr(target, "tags", ()):
        builder = pointwise_rule
    if builder is None:
        if not has_time and not (node.name in bc.tl.info and bc.tl[node].time_dims):
            return NodeRule((), tuple(None for _ in slots_of(node)), default_run)
        raise node_error(node, f"gradshard does not know how `{qual or _opname(node)}` reads the time "
                         "axis, so it cannot run it one chunk at a time",
                         "register a rule with gradshard.runtime.chunk_rules.register_chunk_rule, or "
                         "use plan='none'")
    if not has_time and builder is not _factory_rule:
        return NodeRule((), tuple(None for _ in slots_of(node)), default_run)
    return builder(node, bc)
