"""Time locality: for every node, which time steps of the graph inputs it reads.

Built on :mod:`gradshard.analysis.dims`. First the *time axis* is inferred from the graph:
the dimension class that scans (cumsum/cumprod/linear_scan), attention (the two sides of a
``q @ k^T`` score matrix, SDPA) and unrolled per-timestep loops (``select`` at successive
indices) run along. Then a local rule per op gives how output step ``t`` reads its input's
steps — an interval ``[lo, hi]`` of offsets — and intervals compose along the graph:

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

from .consts import evaluate_constant
from .dims import DimAnalysis, analyze_dims, shape_of

aten = torch.ops.aten
INF = math.inf

__all__ = ["Reach", "TimeInfo", "TimeLocality", "analyze_time_locality", "infer_time_class",
           "NoTimeAxisError", "SCAN_OPS"]


class NoTimeAxisError(ValueError):
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
    ``local``: this node's own rule; ``abs_range``: steps read by an unrolled-loop node;
    ``causal_mask``: the node is a score matrix with a causal mask applied.
    """

    time_dims: tuple[int, ...]
    reach: Reach | None
    local: Reach | None
    abs_range: tuple[int, int] | None = None
    causal_mask: bool = False
    why: str = ""


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
# gradshard custom ops: qualified name -> (time dim of main input, reach)
CUSTOM_TIME_OPS: dict[str, tuple[int, Reach]] = {
    "gradshard::linear_scan": (1, ALL_PAST),
    "gradshard::lightning_attention": (2, ALL_PAST),
}


def _qualname(node: fx.Node) -> str | None:
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet, "_qualified_op_name", None)


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
        user_inputs = [p for p in phs if str(p.meta.get("gs_input_name", "")).startswith("input")] or phs
        idx, d = hint
        ph = user_inputs[idx]
        cls = dims.canon(dims.input_labels[ph.name][d])
        return cls, {str(cls): [f"time_axis hint: input {idx} dim {d}"]}

    selects: dict[int, set[int]] = {}
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
            src = dims.dims_of(node.args[0])
            if src is not None and len(src.dims) > ax:
                add(src.dims[ax], f"{node.name}: {_qualname(node)}")
        elif node.target in (aten.scaled_dot_product_attention.default,):
            q = dims.dims_of(node.args[0])
            if q is not None and len(q.dims) >= 2:
                add(q.dims[-2], f"{node.name}: attention query length")
        elif node.target is aten.select.int and nd is not None:
            for l in nd.selected:
                selects.setdefault(dims.canon(l), set()).add(node.args[2])
        elif node.target in (aten.softmax.int, aten._softmax.default) and nd is not None:
            shp = shape_of(node) or ()
            if len(shp) >= 2 and shp[-1] == shp[-2] and nd.dims[-1] and nd.dims[-2]:
                add(nd.dims[-1] | nd.dims[-2], f"{node.name}: softmax over a square score matrix")
    for cls, idxs in selects.items():
        if len(idxs) >= 2:
            evidence.setdefault(cls, []).append(f"per-step loop: select at {len(idxs)} indices")
    if not evidence:
        raise NoTimeAxisError(
            "no time axis found: the graph has no scan (cumsum/cumprod/linear_scan), no attention "
            "and no per-timestep loop, so nothing in it grows with sequence length along a "
            "recognisable axis.\n  instead: use plan='none', or pass time_axis=(input_index, dim) "
            "to gs.compile if the model does have a sequence dimension."
        )
    best = max(evidence, key=lambda c: len(evidence[c]))
    return best, {str(c): v for c, v in evidence.items()}


# --------------------------------------------------------------------------- local rules


def is_causal_mask(op: Any, mask: fx.Node, scores_arg_first: bool = True) -> bool:
    """Is ``mask`` (a constant) causal as used by ``op``: every future entry masked?

    ``add``/SDPA float masks mask with ``-inf`` (or a very negative number); ``masked_fill``
    masks where True; ``where(cond, scores, -inf)`` and SDPA bool masks keep where True.
    Masking part of the past too (sliding windows) is still causal.
    """
    val = evaluate_constant(mask)
    if val is None or val.dim() < 2 or val.shape[-1] < 2:
        return False
    m = val.detach().reshape(-1, val.shape[-2], val.shape[-1])
    tq, tk = m.shape[-2:]
    future = torch.ones(tq, tk, dtype=torch.bool).triu(1 + tk - tq)
    if op in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        masked = m.bool()
    elif m.dtype == torch.bool:  # where(cond, scores, -inf) / SDPA: True keeps
        masked = ~m
    else:
        masked = torch.isneginf(m) | (m < -1e4)
    return bool(masked[:, future].all())


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
                          dims: DimAnalysis | None = None) -> TimeLocality:
    """Infer the time axis and give every node its :class:`TimeInfo` (pure analysis)."""
    dims = dims or analyze_dims(gm)
    cls, evidence = infer_time_class(gm, dims, time_axis)
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
        info[node.name] = _node_info(node, tdims, info, dims, cls)
    # normalise "reaches back to step 0 for every t" to all-past
    T = seq_len
    for name, ti in list(info.items()):
        if ti.reach is not None and T and ti.reach.lo <= -(T - 1) and ti.reach.lo != -INF:
            info[name] = TimeInfo(ti.time_dims, Reach(-INF, ti.reach.hi), ti.local, ti.abs_range, ti.causal_mask, ti.why)
    return TimeLocality(dims, cls, seq_len, info, time_inputs, evidence)


def _node_info(node: fx.Node, tdims: tuple[int, ...], info: dict[str, TimeInfo], dims: DimAnalysis, cls: int) -> TimeInfo:
    ins = [info[a.name] for a in node.all_input_nodes if a.name in info]
    timed = [i for i in ins if i.reach is not None]
    if not timed:
        return TimeInfo(tdims, None, None, why="does not depend on time")
    base = timed[0].reach if timed[0].reach is not None else POINTWISE
    for t in timed[1:]:
        base = base.join(t.reach)  # type: ignore[arg-type]
    abs_ranges = [i.abs_range for i in timed if i.abs_range is not None]
    abs_range = (min(a for a, _ in abs_ranges), max(b for _, b in abs_ranges)) if abs_ranges else None
    causal = any(i.causal_mask for i in timed)
    tgt = node.target
    qual = _qualname(node)
    in_time = next((i.time_dims for i in timed if i.time_dims), ())
    t_in = in_time[0] if len(in_time) == 1 else None
    src_ti = info.get(node.args[0].name) if node.args and isinstance(node.args[0], fx.Node) else None
    src_td = src_ti.time_dims[0] if src_ti is not None and len(src_ti.time_dims) == 1 else None

    def make(local: Reach, why: str, **kw: Any) -> TimeInfo:
        return TimeInfo(tdims, base.then(local), local, kw.get("abs_range", abs_range), kw.get("causal", causal), why)

    if tgt is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].name in info \
            and node.args[0].target is not aten.unbind.int:
        src = info[node.args[0].name]
        return TimeInfo(tdims, src.reach, src.local, src.abs_range, src.causal_mask, src.why)
    # loop step: select along time reads one absolute step
    src_nd = len(shape_of(node.args[0]) or ()) if node.args and isinstance(node.args[0], fx.Node) else 0
    if tgt is aten.select.int and src_td is not None and node.args[1] % max(src_nd, 1) == src_td:
        i = int(node.args[2])
        i = i if i >= 0 else i + (shape_of(node.args[0]) or (0,))[src_td]
        return TimeInfo((), base, None, (i + base.lo if base.lo != -INF else -INF, i + base.hi), causal, f"loop step {i}")
    if tgt is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.unbind.int:
        i = int(node.args[1])
        return TimeInfo(tdims, base, None, (i, i) if not tdims else abs_range, causal, f"loop step {i}")
    if tgt in (aten.stack.default, aten.cat.default) and abs_range is not None and tdims:
        return _stack_info(node, tdims, info, base)
    if not tdims:
        if abs_range is not None:
            return TimeInfo((), base, None, abs_range, causal, "loop body")
        if any(i.time_dims for i in timed):
            return TimeInfo((), GLOBAL, GLOBAL, None, False, "reduces over the time axis")
        return TimeInfo((), base, None, None, causal, "")
    # time-carrying nodes
    if tgt in SCAN_OPS:
        ax = node.args[1] % max(len(shape_of(node) or (1,)), 1)
        if ax in tdims:
            return make(ALL_PAST, f"{tgt._overloadpacket.__name__} along time")
        return make(POINTWISE, "scan along a non-time axis")
    if qual in CUSTOM_TIME_OPS:
        rev = bool(node.kwargs.get("reverse", False)) or (len(node.args) > 3 and node.args[3] is True)
        return make(Reach(0, INF) if rev else ALL_PAST, f"{qual}")
    if tgt is aten.slice.Tensor and src_td is not None:
        return make(_shift_of_slice(node, src_td) or POINTWISE, "slice")
    if tgt in (aten.constant_pad_nd.default, aten.pad.default) and src_td is not None:
        return make(_pad_shift(node, src_td, len(shape_of(node) or ())), "pad")
    if tgt in (aten.conv1d.default, aten.convolution.default) and src_td is not None:
        if src_td == len(shape_of(node.args[0]) or ()) - 1:
            return make(_conv_reach(node), "convolution along time")
        return make(POINTWISE, "convolution across time-independent positions")
    if tgt in (aten.flip.default, aten.roll.default, aten.index_select.default, aten.gather.default,
               aten.index.Tensor) and src_td is not None:
        axis_args = node.args[1] if len(node.args) > 1 else None
        axes = axis_args if isinstance(axis_args, (list, tuple)) else [axis_args]
        if tgt is aten.index.Tensor or any(a is not None and a % len(shape_of(node) or (1,)) == src_td for a in axes):
            return make(GLOBAL, "reorders or gathers along time")
        return make(POINTWISE, "indexing along a non-time axis")
    if tgt in (aten.scaled_dot_product_attention.default,):
        is_causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if is_causal or (isinstance(mask, fx.Node) and is_causal_mask(tgt, mask)):
            return make(ALL_PAST, "causal attention")
        return make(GLOBAL, "non-causal attention reads future steps")
    if len(tdims) == 2:  # a T x T score matrix (q @ k^T), possibly masked
        mask_nodes = [a for a in node.all_input_nodes if info.get(a.name) is not None and info[a.name].reach is None]
        now_causal = causal or any(is_causal_mask(tgt, m) for m in mask_nodes)
        return TimeInfo(tdims, base, POINTWISE, abs_range, now_causal, "score matrix" + (" (causal mask)" if now_causal else ""))
    contracted = [i for i in timed if len(i.time_dims) == 2]
    if contracted and len(tdims) == 1:
        if any(i.causal_mask for i in contracted):
            return make(ALL_PAST, "attention: causally masked scores times values")
        return make(GLOBAL, "attention without a causal mask reads future steps")
    if tgt in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.softmax.int, aten._softmax.default,
               aten.log_softmax.int, aten.logsumexp.default, aten.prod.dim_int, aten.var.correction,
               aten.layer_norm.default, aten.rms_norm.default, aten.group_norm.default):
        red = node.args[1] if len(node.args) > 1 else None
        red = [red] if isinstance(red, int) else list(red or [])
        nd = len(shape_of(node.args[0]) or ())
        if tgt in (aten.layer_norm.default, aten.rms_norm.default):
            red = list(range(nd - len(node.args[1]), nd))
        if tgt is aten.group_norm.default:
            red = list(range(1, nd))
        if src_td is not None and any(r % nd == src_td for r in red):
            return make(GLOBAL, "normalises or reduces along time")
    if dims.nodes.get(node.name) is not None and node.name in dims.opaque:
        return make(GLOBAL, "unknown op: assumed to read every step")
    return make(POINTWISE, "time-local")


def _stack_info(node: fx.Node, tdims: tuple[int, ...], info: dict[str, TimeInfo], base: Reach) -> TimeInfo:
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
