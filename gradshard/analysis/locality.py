"""Time locality: for every node, which time steps of the graph inputs it reads.

Built on :mod:`gradshard.analysis.dims`. First the *time axis* is inferred from the graph:
the dimension class that scans (cumsum/cumprod/linear_scan), attention (the two sides of a
``q @ k^T`` score matrix, SDPA) and unrolled per-timestep loops (``select`` at successive
indices) run along; a scan along the blocks of an axis reshaped into ``(T/c, c)`` counts for
that axis, and a class holding an axis of the caller's inputs wins over one that holds none.
Then a local rule per op gives how output step ``t`` reads its input's steps — an interval
``[lo, hi]`` of offsets — and intervals compose along the graph:

=====================  ======================================================
pointwise, views       ``[0, 0]``
slice/pad along time   a shift ``[s, s]``
conv1d (kernel K)      ``[-pad, -pad + dilation*(K-1)]`` (causal conv: a window)
cumsum, scan, causal   ``[-inf, 0]`` (all of the past)
attention
reduction over time,   ``[-inf, inf]`` (global: the node reads the future)
non-causal attention
=====================  ======================================================

Nodes of an unrolled loop have no time axis; they read absolute steps (``abs_range``) and
``stack`` turns them back into a time axis with the composed relative reach.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from gradshard.errors import GradshardError
from gradshard.ir import is_call_input

from .dim_core import iota_length
from .dims import DimAnalysis, analyze_dims, shape_of
from .masks import is_causal_mask

aten = torch.ops.aten
INF = math.inf

__all__ = ["Reach", "TimeInfo", "TimeLocality", "analyze_time_locality", "infer_time_class",
           "NoTimeAxisError", "SCAN_OPS"]


class NoTimeAxisError(GradshardError, ValueError):
    """The graph has no dimension that behaves like time."""


@dataclass(frozen=True)
class Reach:
    """Offsets ``[lo, hi]`` of the input time steps that output step ``t`` reads."""

    lo: float = 0
    hi: float = 0

    @property
    def is_pointwise(self) -> bool:
        return self.lo == 0 and self.hi == 0

    @property
    def is_causal(self) -> bool:
        return self.hi <= 0

    @property
    def reads_all_past(self) -> bool:
        return self.lo == -INF

    @property
    def window(self) -> float:
        """Width of the causal window (``inf`` for all of the past)."""
        return self.hi - self.lo + 1

    def then(self, other: "Reach") -> "Reach":
        """Compose: ``other`` applied after ``self`` (Minkowski sum of the intervals)."""
        return Reach(self.lo + other.lo, self.hi + other.hi)

    def join(self, other: "Reach") -> "Reach":
        return Reach(min(self.lo, other.lo), max(self.hi, other.hi))

    def __str__(self) -> str:
        if self.is_pointwise:
            return "pointwise"
        if self.lo == -INF and self.hi == INF:
            return "global"
        if self.lo == -INF:
            return "all-past" if self.hi == 0 else f"all-past(+{self.hi:g})"
        if self.hi == INF:
            return "all-future"
        return f"window[{self.lo:g},{self.hi:g}]"


POINTWISE = Reach(0, 0)
ALL_PAST = Reach(-INF, 0)
GLOBAL = Reach(-INF, INF)


@dataclass(frozen=True)
class TimeInfo:
    """Time facts of one node.

    ``time_dims``: output dims on the time axis (two for a ``T x T`` score matrix);
    ``reach``: composed reach from the graph inputs (``None`` if it does not depend on time);
    ``local``: this node's own rule; ``abs_range``: absolute steps read by a node without a
    time axis (a loop step, a block's state); ``causal_mask``: the node is a score matrix
    with a causal mask applied; ``origin``: absolute step of index 0 on the time dim.
    """

    time_dims: tuple[int, ...]
    reach: Reach | None
    local: Reach | None
    abs_range: tuple[float, float] | None = None
    causal_mask: bool = False
    why: str = ""
    origin: int = 0  # absolute step of index 0 along the time dim (moved by slices/pads)
    abs_max: float | None = None  # latest absolute step any element reads (time-carrying nodes)


@dataclass
class TimeLocality:
    """Result of :func:`analyze_time_locality`."""

    dims: DimAnalysis
    time_class: int
    seq_len: int
    info: dict[str, TimeInfo]
    time_inputs: dict[str, int]  # placeholder name -> its time dim
    evidence: dict[str, list[str]]

    def __getitem__(self, node: fx.Node | str) -> TimeInfo:
        return self.info[node if isinstance(node, str) else node.name]

    def time_dim(self, node: fx.Node | str) -> int | None:
        td = self[node].time_dims
        return td[0] if len(td) == 1 else None

    def non_local_nodes(self) -> list[str]:
        """Nodes whose own rule reads unboundedly far (scans, attention, reductions over time)."""
        return [n for n, i in self.info.items() if i.local is not None and math.isinf(i.local.window)]


# Ops that run along an axis and read all of the past (axis given by the arg at index).
SCAN_OPS: dict[Any, int] = {
    aten.cumsum.default: 1,
    aten.cumprod.default: 1,
    aten.logcumsumexp.default: 1,
    aten.cummax.default: 1,
    aten.cummin.default: 1,
}
# Ops that read only their inputs' metadata (shape, dtype, device), never the data.
DATA_INDEPENDENT = {aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full, aten.zeros_like,
                    aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like}
# gradshard custom ops: qualified name -> (time dim of main input, reach). Each op registers
# its entry where it is defined (gradshard/ops/), with :func:`register_time_op`. A graph-level
# Python function (``run_carried_loop``) is keyed by itself; its time dim is its output's.
CUSTOM_TIME_OPS: dict[Any, tuple[int, Reach]] = {}


def register_time_op(qualname: Any, *, time_dim: int, reach: Reach) -> None:
    """Declare how custom op ``qualname`` reads time: along ``time_dim`` of its main input,
    each output step reading the input steps ``reach`` around it. ``qualname`` may be a Python
    function called by graph nodes: then ``time_dim`` is the time dim of its output."""
    CUSTOM_TIME_OPS[qualname] = (time_dim, reach)


def _qualname(node: fx.Node) -> Any:
    packet = getattr(node.target, "_overloadpacket", None)
    if packet is None:
        target = node.target
        return target if callable(target) and target in CUSTOM_TIME_OPS else None
    return getattr(packet, "_qualified_op_name", None)


def _op_label(qual: Any) -> str:
    return qual if isinstance(qual, str) else getattr(qual, "__name__", str(qual))


# --------------------------------------------------------------------------- time class


def infer_time_class(gm: fx.GraphModule, dims: DimAnalysis, hint: tuple[int, int] | None = None) -> tuple[int, dict[str, list[str]]]:
    """Pick the dimension class that behaves like time; return it and the evidence per class.

    ``hint=(input_index, dim)`` overrides the inference (for models whose time axis shows no
    scan, attention or loop, e.g. a purely convolutional model).
    """
    evidence: dict[int, list[str]] = {}

    def add(labels, why: str) -> None:
        for cls in {dims.canon(l) for l in labels}:
            evidence.setdefault(cls, []).append(why)

    if hint is not None:
        phs = list(gm.graph.find_nodes(op="placeholder"))
        user_inputs = [p for p in phs if is_call_input(p, untagged=False)] or phs
        idx, d = hint
        ph = user_inputs[idx]
        cls = dims.canon(dims.input_labels[ph.name][d])
        return cls, {str(cls): [f"time_axis hint: input {idx} dim {d}"]}

    selects: dict[int, set[int]] = {}
    slices: dict[int, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        nd = dims.dims_of(node)
        if node.target in SCAN_OPS:
            src = dims.dims_of(node.args[0])
            if src is not None and src.dims:
                ax = node.args[1] % len(src.dims)
                add(src.dims[ax], f"{node.name}: {node.target._overloadpacket.__name__} along dim {ax}")
        elif _qualname(node) in CUSTOM_TIME_OPS:
            ax, _ = CUSTOM_TIME_OPS[_qualname(node)]
            if not isinstance(_qualname(node), str):  # a graph-level function: its output's dim
                if nd is not None and len(nd.dims) > ax and nd.dims[ax]:
                    add(nd.dims[ax], f"{node.name}: {_op_label(_qualname(node))}")
                continue
            for arg in node.args[:3]:  # the first operand may broadcast over time (a of a scan)
                src = dims.dims_of(arg) if isinstance(arg, fx.Node) else None
                if src is not None and len(src.dims) > ax and src.dims[ax]:
                    add(src.dims[ax], f"{node.name}: {_qualname(node)}")
                    break
        elif node.target in (aten.scaled_dot_product_attention.default,):
            q = dims.dims_of(node.args[0])
            if q is not None and len(q.dims) >= 2:
                add(q.dims[-2], f"{node.name}: attention query length")
        elif node.target is aten.select.int and nd is not None:
            for l in nd.selected:
                selects.setdefault(dims.canon(l), set()).add(node.args[2])
        elif node.target is aten.unbind.int:
            src = dims.dims_of(node.args[0])
            n_out = len(node.meta.get("val") or ())
            if src is not None and src.dims and n_out >= 2:
                ax = (node.args[1] if len(node.args) > 1 else 0) % len(src.dims)
                for l in src.dims[ax]:
                    selects.setdefault(dims.canon(l), set()).update(range(n_out))
        elif node.target is aten.slice.Tensor and nd is not None and len(node.args) > 2:
            src = dims.dims_of(node.args[0])
            if src is not None and src.dims:
                ax = node.args[1] % len(src.dims)
                for l in src.dims[ax]:
                    slices.setdefault(dims.canon(l), set()).add(node.args[2] or 0)
        elif node.target in (aten.matmul.default, aten.bmm.default, aten.einsum.default) and nd is not None:
            shp = shape_of(node) or ()
            if (len(nd.dims) >= 2 and nd.dims[-1] and nd.dims[-2] and shp[-1] > 1
                    and _last_two_from_different_operands(node)):
                c1 = {dims.canon(l) for l in nd.dims[-1]}
                c2 = {dims.canon(l) for l in nd.dims[-2]}
                if c1 & c2:
                    add(nd.dims[-1] & nd.dims[-2] or nd.dims[-1], f"{node.name}: token-token product (q k^T)")
        elif node.target in (aten.softmax.int, aten._softmax.default) and nd is not None:
            shp = shape_of(node) or ()
            if len(shp) >= 2 and shp[-1] == shp[-2] and nd.dims[-1] and nd.dims[-2]:
                add(nd.dims[-1] | nd.dims[-2], f"{node.name}: softmax over a square score matrix")
    for cls, idxs in selects.items():
        if len(idxs) >= 2:
            evidence.setdefault(cls, []).append(f"per-step loop: select at {len(idxs)} indices")
    for cls, starts in slices.items():
        if len(starts) >= 3:
            evidence.setdefault(cls, []).append(f"chunked loop: slices at {len(starts)} offsets")
    evidence = _credit_split_wholes(evidence, dims)
    if not evidence:
        raise NoTimeAxisError(
            "no time axis found: the graph has no scan (cumsum/cumprod/linear_scan), no attention "
            "and no per-timestep loop, so nothing in it grows with sequence length along a "
            "recognisable axis.\n  instead: use plan='none', or pass time_axis=(input_index, dim) "
            "to gs.compile if the model does have a sequence dimension."
        )
    holds_input = _classes_with_input_axes(gm, dims)
    # a class holding an axis of the caller's inputs first: one that holds none cannot give the
    # inputs a time axis (SSD's in-block cumsums outnumber a hybrid's attention layers)
    best = max(evidence, key=lambda c: (c in holds_input, len(evidence[c])))
    return best, {str(c): v for c, v in evidence.items()}


def _credit_split_wholes(evidence: dict[int, list[str]], dims: DimAnalysis) -> dict[int, list[str]]:
    """Count the evidence on the pieces of a split dim for the dim it was split from too.

    A time axis reshaped into ``(T/c, c)`` blocks (Mamba-2's SSD) runs its cumsums along the
    blocks, whose labels are fresh (:class:`gradshard.analysis.dim_core.SplitRecord`): a scan
    along a block of an axis is a scan along that axis. Pieces of pieces count too; each piece
    class once per whole.
    """
    children: dict[int, set[int]] = {}
    for rec in dims.splits:
        for w in {dims.canon(l) for l in rec.whole}:
            children.setdefault(w, set()).update(dims.canon(l) for l, _ in rec.pieces)
    out = {c: list(v) for c, v in evidence.items()}
    for whole in children:
        seen, stack = {whole}, list(children[whole])
        while stack:
            piece = stack.pop()
            if piece in seen:
                continue
            seen.add(piece)
            stack.extend(children.get(piece, ()))
            out.setdefault(whole, []).extend(f"{why} (a block of this axis)" for why in evidence.get(piece, ()))
        if not out.get(whole):
            out.pop(whole, None)
    return out


def _classes_with_input_axes(gm: fx.GraphModule, dims: DimAnalysis) -> set[int]:
    """Classes of the dims of the graph's user inputs (all placeholders when none is tagged)."""
    phs = list(gm.graph.find_nodes(op="placeholder"))
    user = [p for p in phs if is_call_input(p, untagged=False)] or phs
    return {dims.canon(l) for p in user for l in dims.input_labels.get(p.name, ())}


# --------------------------------------------------------------------------- local rules


def _shift_of_slice(node: fx.Node, time_dim: int) -> Reach | None:
    dim = node.args[1] if len(node.args) > 1 else 0
    src_shape = shape_of(node.args[0]) or ()
    if dim % max(len(src_shape), 1) != time_dim:
        return POINTWISE
    start = node.args[2] if len(node.args) > 2 else 0
    step = node.args[4] if len(node.args) > 4 else 1
    if start is None:
        start = 0
    if start < 0:
        start += src_shape[time_dim]
    if step != 1:
        return GLOBAL
    return Reach(start, start)


def _pad_shift(node: fx.Node, time_dim: int, nd: int) -> Reach:
    pads = list(node.args[1])
    # pads are given last dim first: (left_last, right_last, left_prev, right_prev, ...)
    k = nd - 1 - time_dim
    left = pads[2 * k] if 2 * k < len(pads) else 0
    return Reach(-left, -left)


def _conv_reach(node: fx.Node) -> Reach:
    w = shape_of(node.args[1]) or ()
    k = w[-1] if w else 1
    if node.target is aten.conv1d.default:
        padding = node.args[4] if len(node.args) > 4 else 0
        dilation = node.args[5] if len(node.args) > 5 else 1
        stride = node.args[3] if len(node.args) > 3 else 1
    else:  # aten.convolution
        stride, padding, dilation = node.args[3], node.args[4], node.args[5]
    pick = lambda v: v[-1] if isinstance(v, (list, tuple)) else v  # noqa: E731
    padding, dilation, stride = pick(padding), pick(dilation), pick(stride)
    if isinstance(padding, str) or stride != 1:
        return GLOBAL
    return Reach(-padding, -padding + dilation * (k - 1))


def analyze_time_locality(gm: fx.GraphModule, *, time_axis: tuple[int, int] | None = None,
                          dims: DimAnalysis | None = None,
                          example_inputs: Any = None) -> TimeLocality:
    """Infer the time axis and give every node its :class:`TimeInfo` (pure analysis).

    ``example_inputs`` (the flat placeholder values) lets mask analysis read parameters and
    buffers without a time axis (e.g. the decay rates inside a linear-attention mask).
    """
    dims = dims or analyze_dims(gm)
    cls, evidence = infer_time_class(gm, dims, time_axis)
    known: dict[str, torch.Tensor] = {}
    if example_inputs is not None:
        for ph, val in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
            if isinstance(val, torch.Tensor) and not dims.axes_in_class(ph, cls):
                known[ph.name] = val
    info: dict[str, TimeInfo] = {}
    time_inputs: dict[str, int] = {}
    seq_len = 0
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        tdims = dims.axes_in_class(node, cls)
        first = dims.nodes.get(node.name)
        if isinstance(first, tuple) and first and first[0] is not None:  # multi-output op
            tdims = tuple(i for i, ls in enumerate(first[0].dims) if any(dims.canon(l) == cls for l in ls))
        shp = shape_of(node)
        if node.op == "placeholder":
            if tdims:
                time_inputs[node.name] = tdims[0]
                seq_len = max(seq_len, shp[tdims[0]] if shp else 0)
                info[node.name] = TimeInfo(tdims, POINTWISE, None, why="graph input with a time axis")
            else:
                info[node.name] = TimeInfo((), None, None, why="graph input without a time axis")
            continue
        info[node.name] = _node_info(node, tdims, info, dims, cls, known)
    # normalise "reaches back to step 0 for every t" to all-past
    T = seq_len
    for name, ti in list(info.items()):
        if ti.reach is not None and T and ti.reach.lo <= -(T - 1) and ti.reach.lo != -INF:
            local = ti.local
            if local is not None and local.lo <= -(T - 1):
                local = Reach(-INF, local.hi)
            info[name] = TimeInfo(ti.time_dims, Reach(-INF, ti.reach.hi), local, ti.abs_range, ti.causal_mask, ti.why, ti.origin, ti.abs_max)
    return TimeLocality(dims, cls, seq_len, info, time_inputs, evidence)


def _node_info(node: fx.Node, tdims: tuple[int, ...], info: dict[str, TimeInfo], dims: DimAnalysis, cls: int,
               known: dict[str, torch.Tensor]) -> TimeInfo:
    """Time facts of ``node`` from its inputs' facts and its op's local rule.

    Positions are tracked absolutely: a time-carrying node with ``origin`` o and reach
    [lo, hi] has its element p read graph-input steps [o+p+lo, o+p+hi]; a node without a
    time axis that depends on time reads the absolute steps ``abs_range``. A slice along
    time moves the origin, so block-wise loops (a state summarising block i, read by block
    j > i) come out causal.
    """
    timed = [(a, info[a.name]) for a in node.all_input_nodes if a.name in info and info[a.name].reach is not None]
    if not timed or getattr(node.target, "_overloadpacket", None) in DATA_INDEPENDENT:
        return TimeInfo(tdims, None, None, why="does not depend on time")
    tgt = node.target
    qual = _qualname(node)
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    src_ti = info.get(src.name) if src is not None else None
    src_td = src_ti.time_dims[0] if src_ti is not None and len(src_ti.time_dims) == 1 else None
    src_shape = shape_of(src) or () if src is not None else ()
    causal = any(i.causal_mask for _, i in timed)

    unbind_time = (src is not None and src.target is aten.unbind.int and src_ti is not None
                   and len(src_ti.time_dims) == 0 and _unbind_was_time(src, info))
    if tgt is operator.getitem and src_ti is not None and not unbind_time:
        return src_ti  # element of a multi-output op: same facts
    out_shape = shape_of(node)
    if out_shape is None and isinstance(node.meta.get("val"), (tuple, list)) and node.meta["val"]:
        first_val = node.meta["val"][0]  # multi-output op: facts of its first output
        out_shape = tuple(first_val.shape) if isinstance(first_val, torch.Tensor) else None
    out_len = out_shape[tdims[0]] if tdims and out_shape else 1
    # a length-1 time dim broadcast over a longer one is one absolute step, not a position
    single = {a.name for a, i in timed if i.time_dims and _time_len(a, i) == 1 and out_len > 1}
    with_t = [(a, i) for a, i in timed if i.time_dims and a.name not in single]
    origin = with_t[0][1].origin if with_t else 0
    # a time axis rebuilt from nodes without one (blocks merged back): element p reads the
    # absolute steps they read, so its relative reach spans the whole output length
    length = _time_len(with_t[0][0], with_t[0][1]) if with_t else out_len
    base: Reach | None = None
    abs_lo, abs_hi = INF, -INF
    for a, i in timed:
        if a.name in single:
            a_lo, a_hi = i.origin + i.reach.lo, _latest(a, i)
            c = Reach(a_lo - (origin + length - 1), a_hi - origin)
        elif i.time_dims:
            c = i.reach.then(Reach(i.origin - origin, i.origin - origin))
            a_lo, a_hi = i.origin + i.reach.lo, _latest(a, i)
        elif i.abs_range is not None:
            a_lo, a_hi = i.abs_range
            c = Reach(a_lo - (origin + length - 1), a_hi - origin)
        else:
            c, a_lo, a_hi = i.reach, -INF, INF
        base = c if base is None else base.join(c)
        abs_lo, abs_hi = min(abs_lo, a_lo), max(abs_hi, a_hi)
    assert base is not None
    abs_range = (abs_lo, abs_hi)

    def make(local: Reach, why: str, *, origin_: int | None = None, causal_: bool | None = None) -> TimeInfo:
        o = origin if origin_ is None else origin_
        reach = base.then(local)
        latest = o + out_len - 1 + reach.hi
        if local.hi <= 0:  # reads no later than its inputs do
            latest = min(latest, abs_hi)
        return TimeInfo(tdims, reach, local, None, causal if causal_ is None else causal_, why, o, latest)

    # loop step: select along time reads one absolute step
    if tgt is aten.select.int and src_td is not None and node.args[1] % max(len(src_shape), 1) == src_td:
        i = int(node.args[2])
        i = i if i >= 0 else i + src_shape[src_td]
        at = src_ti.origin + i
        return TimeInfo((), src_ti.reach, None, (at + src_ti.reach.lo, at + src_ti.reach.hi), causal, f"loop step {i}")
    if tgt is operator.getitem and unbind_time:
        base_ti = info[src.args[0].name]
        i = int(node.args[1]) + base_ti.origin
        return TimeInfo((), base_ti.reach, None, (i + base_ti.reach.lo, i + base_ti.reach.hi), causal, f"loop step {i}")
    if not tdims:
        if not with_t:
            return TimeInfo((), base, None, abs_range, causal, "loop body")
        return TimeInfo((), GLOBAL, GLOBAL, abs_range, False, "reduces over the time axis")
    if tgt in (aten.stack.default, aten.cat.default) and not with_t:
        return _stack_info(node, tdims, info)
    if tgt is aten.cat.default and with_t:
        return _cat_info(node, tdims, info, causal)
    # time-carrying nodes
    if tgt in SCAN_OPS:
        ax = node.args[1] % max(len(shape_of(node) or (1,)), 1)
        if ax in tdims:
            return make(ALL_PAST, f"{tgt._overloadpacket.__name__} along time")
        return make(POINTWISE, "scan along a non-time axis")
    if qual in CUSTOM_TIME_OPS:
        rev = bool(node.kwargs.get("reverse", False)) or (len(node.args) > 3 and node.args[3] is True)
        return make(Reach(0, INF) if rev else ALL_PAST, _op_label(qual))
    if tgt is aten.slice.Tensor and src_td is not None:
        dim = (node.args[1] if len(node.args) > 1 else 0) % max(len(src_shape), 1)
        if dim != src_td:
            return make(POINTWISE, "slice along a non-time axis")
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        start = start + src_shape[src_td] if start < 0 else min(start, src_shape[src_td])
        step = node.args[4] if len(node.args) > 4 else 1
        if step != 1:
            return make(GLOBAL, "strided slice along time")
        return make(POINTWISE, f"slice along time from step {start}", origin_=src_ti.origin + start)
    if tgt in (aten.constant_pad_nd.default, aten.pad.default) and src_td is not None:
        left = -_pad_shift(node, src_td, len(shape_of(node) or ())).lo
        return make(POINTWISE, f"pad {left} steps before", origin_=src_ti.origin - int(left))
    if tgt in (aten.conv1d.default, aten.convolution.default) and src_td is not None:
        if src_td == len(src_shape) - 1:
            return make(_conv_reach(node), "convolution along time")
        return make(POINTWISE, "convolution across time-independent positions")
    if tgt in (aten.flip.default, aten.roll.default, aten.index_select.default, aten.gather.default,
               aten.index.Tensor) and src_td is not None:
        axis_args = node.args[1] if len(node.args) > 1 else None
        axes = axis_args if isinstance(axis_args, (list, tuple)) else [axis_args]
        if (tgt is aten.index.Tensor and src_td < len(node.args[1])
                and iota_length(node.args[1][src_td]) == (shape_of(src) or ())[src_td]):
            return make(POINTWISE, "reads time in order (an arange index over the whole axis)")
        if tgt is aten.index.Tensor or any(a is not None and a % len(shape_of(node) or (1,)) == src_td for a in axes):
            return make(GLOBAL, "reorders or gathers along time")
        return make(POINTWISE, "indexing along a non-time axis")
    if tgt in (aten.scaled_dot_product_attention.default,):
        is_causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if is_causal or (isinstance(mask, fx.Node) and is_causal_mask(tgt, mask, known)):
            return make(ALL_PAST, "causal attention")
        return make(GLOBAL, "non-causal attention reads future steps")
    if len(tdims) == 2:  # a T x T score matrix (q @ k^T), possibly masked
        mask_nodes = [a for a in node.all_input_nodes if info.get(a.name) is not None and info[a.name].reach is None]
        now_causal = causal or any(is_causal_mask(tgt, m, known) for m in mask_nodes)
        return make(POINTWISE, "score matrix" + (" (causal mask)" if now_causal else ""), causal_=now_causal)
    if tgt is aten.linalg_solve_triangular.default and any(len(i.time_dims) == 2 for _, i in timed):
        # a solve along time reads only A's triangle: lower from the left is forward
        # substitution (row t reads rows <= t); upper or from the right reads later rows
        upper = node.args[2] if len(node.args) > 2 else node.kwargs.get("upper")
        left = node.args[3] if len(node.args) > 3 else node.kwargs.get("left", True)
        if upper or not left:
            return make(GLOBAL, "triangular solve by back substitution reads later steps", causal_=False)
        return make(ALL_PAST, "triangular solve by forward substitution along time", causal_=False)
    contracted = [i for _, i in timed if len(i.time_dims) == 2]
    if contracted and len(tdims) == 1:
        if any(i.causal_mask for i in contracted):
            return make(ALL_PAST, "attention: causally masked scores times values", causal_=False)
        return make(GLOBAL, "attention without a causal mask reads future steps", causal_=False)
    if tgt in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.softmax.int, aten._softmax.default,
               aten.log_softmax.int, aten.logsumexp.default, aten.prod.dim_int, aten.var.correction,
               aten.layer_norm.default, aten.rms_norm.default, aten.group_norm.default):
        red = node.args[1] if len(node.args) > 1 else None
        red = [red] if isinstance(red, int) else list(red or [])
        nd = len(src_shape)
        if tgt in (aten.layer_norm.default, aten.rms_norm.default):
            red = list(range(nd - len(node.args[1]), nd))
        if tgt is aten.group_norm.default:
            red = list(range(1, nd))
        if src_td is not None and any(r % nd == src_td for r in red):
            return make(GLOBAL, "normalises or reduces along time")
    if dims.nodes.get(node.name) is not None and node.name in dims.opaque:
        return make(GLOBAL, f"unknown op {getattr(tgt, '__name__', tgt)}: assumed to read every step")
    return make(POINTWISE, "time-local")


def _unbind_was_time(unbind: fx.Node, info: dict[str, TimeInfo]) -> bool:
    """Did this ``unbind`` split its input along the time axis (a loop over steps)?"""
    src = unbind.args[0]
    ti = info.get(src.name) if isinstance(src, fx.Node) else None
    if ti is None or len(ti.time_dims) != 1:
        return False
    dim = unbind.args[1] if len(unbind.args) > 1 else unbind.kwargs.get("dim", 0)
    return dim % max(len(shape_of(src) or ()), 1) == ti.time_dims[0]


def _latest(node: fx.Node, ti: TimeInfo) -> float:
    """The latest absolute step any element of a time-carrying node reads (unknown reach: any)."""
    if ti.reach is None:
        return INF
    bound = ti.origin + _time_len(node, ti) - 1 + ti.reach.hi
    return min(bound, ti.abs_max) if ti.abs_max is not None else bound


def _time_len(node: fx.Node, ti: TimeInfo) -> int:
    shp = shape_of(node)
    if shp is None and isinstance(node.meta.get("val"), (tuple, list)) and node.meta["val"]:
        v = node.meta["val"][0]
        shp = tuple(v.shape) if isinstance(v, torch.Tensor) else None
    return shp[ti.time_dims[0]] if shp and ti.time_dims else 1


def _cat_info(node: fx.Node, tdims: tuple[int, ...], info: dict[str, TimeInfo], causal: bool) -> TimeInfo:
    """``cat`` along time of blocks with their own origins (block-wise loops)."""
    pieces = [p for p in node.args[0] if isinstance(p, fx.Node)]
    out_shape = shape_of(node) or ()
    dim = (node.args[1] if len(node.args) > 1 else 0) % max(len(out_shape), 1)
    first = next((info[p.name] for p in pieces if p.name in info and info[p.name].time_dims), None)
    origin = first.origin if first else 0
    reach: Reach | None = None
    offset = 0
    along_time = bool(tdims) and dim == tdims[0]
    for p in pieces:
        pi = info.get(p.name)
        n = (shape_of(p) or (0,) * (dim + 1))[dim]
        if pi is not None and pi.reach is not None:
            shift = (pi.origin - offset - origin) if along_time else (pi.origin - origin)
            c = pi.reach.then(Reach(shift, shift)) if pi.time_dims else GLOBAL
            reach = c if reach is None else reach.join(c)
        offset += n
    reach = reach or POINTWISE
    latest = max((_latest(p, info[p.name]) for p in pieces if p.name in info and info[p.name].time_dims), default=None)
    return TimeInfo(tdims, reach, POINTWISE, None, causal,
                    "concatenates blocks along time" if along_time else "concatenates", origin, latest)


def _stack_info(node: fx.Node, tdims: tuple[int, ...], info: dict[str, TimeInfo]) -> TimeInfo:
    """``stack`` of loop steps: piece j reading absolute steps [a_j, b_j] reads [a_j-j, b_j-j]."""
    pieces = [p for p in node.args[0] if isinstance(p, fx.Node)]
    lo, hi = INF, -INF
    for j, p in enumerate(pieces):
        ar = info[p.name].abs_range if p.name in info else None
        if ar is None:
            continue
        lo, hi = min(lo, ar[0] - j), max(hi, ar[1] - j)
    if lo == INF:
        lo, hi = 0, 0
    reach = Reach(lo, hi)
    return TimeInfo(tdims, reach, reach, None, False, f"stack of {len(pieces)} loop steps")


def _last_two_from_different_operands(node: fx.Node) -> bool:
    """Whether a contraction's last two output dims come from different operands, as the query
    and key lengths of ``q @ k^T`` do. An einsum such as ``bn,bhnp->bhp`` takes both from one
    operand (a per-head split of one channel dim): no token-token product."""
    if node.target is not aten.einsum.default:
        return True  # matmul/bmm: rows from the first operand, columns from the second
    eq = str(node.args[0]).replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    if not rhs or "..." in eq or len(rhs) < 2:
        return True
    specs = lhs.split(",")
    owners = [{i for i, sp in enumerate(specs) if c in sp} for c in rhs[-2:]]
    return not (len(owners[0]) == 1 and owners[0] == owners[1])
