"""Cut one linear-recurrence region (one layer) out of a graph: producers, scan, readout.

Given a :class:`~gradshard.passes.detect_recurrence.ScanSite` (``a``, ``u``, ``h0``, ``h``):

* **readout** -- the nodes after ``h`` that still carry the state: starting from ``h``,
  every pointwise-in-time op that consumes a value with a *state* dim (a dim class of ``h``
  that the layer input does not have, e.g. Mamba's ``N``), or whose time dim is merged with
  another dim; the op that contracts the last state dim (``einsum(c, h)``) is the exit.
  ``h[:, -1]`` (the final state) becomes an extra region output.
  Past the contraction the readout may go on through pointwise-in-time nodes (Mamba's
  ``y + D x``, gate, norm, ``out_proj``) where the region then reads and writes fewer bytes per
  step: the contracted ``y`` is no longer an output some other segment keeps.
* **producers** -- walking back from ``a``, ``u``, ``h0`` and the readout's other inputs,
  every node whose (live) users are all in the region and that is time-local; where the walk
  stops are the region inputs (the residual stream, parameters). A constant built in the
  graph that differs between positions (``arange`` positions, a first-step reset mask) is
  a region input too, sliced per shard, never recomputed by a shard.
* **halo** -- producers are checked time-local relative to the region inputs: reach
  ``[lo, hi]`` (a causal conv1d of width ``w`` reads ``[-(w-1), 0]``) and boundary extents
  (positions near a window edge that differ from a shift-invariant computation: zero
  padding, a first step handled apart via ``cat``). Each shard recomputes its producers on
  ``[s - lh, e + rh)`` and keeps ``[s, e)``.

Anything that would make a shard recompute differ from the full computation is an error
naming the node: producers reading unboundedly far (a cumsum feeding ``a``), a readout that is not pointwise in time.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.analysis.node_costs import tensor_bytes
from gradshard.errors import node_error
from gradshard.plans.adjoint.layout import RegionIO, ScanSpec

from gradshard.passes.detect_recurrence import ScanSite
from gradshard.passes.recurrence_graph import live_users

aten = torch.ops.aten

__all__ = ["RegionPlan", "extract_region"]

#: nodes after a readout considered for taking into the region (a Mamba block's gate, norm and
#: out_proj are ~15)
MAX_READOUT_EXTENSION = 48

_INSTEAD = "use plan='seco' (chunked recomputation of the whole model) or per-layer torch.utils.checkpoint"

# ops that read only the shape/dtype/device of their input
METADATA_ONLY = {
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
}
# ops producing the same value at every position from position-free inputs
_UNIFORM = METADATA_ONLY | {
    aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
    aten.expand.default, aten.broadcast_to.default, aten.view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.permute.default, aten.transpose.int, aten.clone.default, aten._to_copy.default, aten.mul.Tensor,
    aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.add.Scalar,
}


@dataclass
class RegionPlan:
    """Everything ``rewrite_adjoint`` needs to install one region."""

    site: ScanSite
    producers: list[fx.Node]
    readout: list[fx.Node]
    inputs: list[fx.Node]
    producer_outputs: list[Optional[fx.Node]]  # a, u, h0, r...
    exits: list[fx.Node]
    final_select: Optional[fx.Node]
    scan: ScanSpec
    io: RegionIO
    notes: list[str] = field(default_factory=list)
    #: nodes after the contracting readout taken into the region (:meth:`_Extractor.readout_extension`)
    extended: int = 0

    @property
    def nodes(self) -> list[fx.Node]:
        return [*self.producers, *self.covered_nodes, *self.readout]

    covered_nodes: list[fx.Node] = field(default_factory=list)


@dataclass(frozen=True)
class _Loc:
    lo: float
    hi: float
    bs: int
    be: int

    def join(self, o: "_Loc") -> "_Loc":
        return _Loc(min(self.lo, o.lo), max(self.hi, o.hi), max(self.bs, o.bs), max(self.be, o.be))


def _val(n: Any) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _classes(tl: Any, n: fx.Node) -> list[set[int]]:
    nd = tl.dims.dims_of(n)
    if nd is None:
        return []
    return [{tl.dims.canon(l) for l in ls} for ls in nd.dims]


def _time_dim(tl: Any, n: fx.Node, what: str) -> Optional[int]:
    info = tl.info.get(n.name)
    if info is None or not info.time_dims:
        return None
    if len(info.time_dims) != 1:
        raise node_error(n, f"the {what} has {len(info.time_dims)} time dims", _INSTEAD)
    return info.time_dims[0]


def _merged_time(tl: Any, n: fx.Node, d: int) -> Optional[tuple[int, int]]:
    """``(outer, inner)`` when dim ``d`` of ``n`` is ``(outer, T, inner)`` merged (rows ``B*T*H``), the
    time factor known to the dims analysis, else None."""
    nd = tl.dims.dims_of(n)
    factors = getattr(nd, "factors", None)
    if not factors or d >= len(factors) or not factors[d]:
        return None
    sizes = [int(size) for _, size in factors[d]]
    timed = [i for i, (labels, _) in enumerate(factors[d]) if {tl.dims.canon(l) for l in labels} == {tl.time_class}]
    shp = _val(n).shape
    if len(timed) != 1 or sizes[timed[0]] != tl.seq_len or math.prod(sizes) != shp[d]:
        return None
    i = timed[0]
    return math.prod(sizes[:i]), math.prod(sizes[i + 1:])


class _Extractor:
    def __init__(self, gm: fx.GraphModule, tl: Any, facts: dict, site: ScanSite, live: set[fx.Node],
                 claimed: set[fx.Node], extend: bool = True) -> None:
        self.gm, self.tl, self.facts, self.site, self.live, self.claimed = gm, tl, facts, site, live, claimed
        self.extend = extend
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.h = self.nodes[site.h]
        self.covered = {self.nodes[c] for c in site.covered}
        self.a = self.nodes[site.a] if site.a else None
        self.u = self.nodes[site.u]
        self.h0 = self.nodes[site.h0] if site.h0 else None

    # ------------------------------------------------------------------ producers

    def timed(self, n: fx.Node) -> bool:
        info = self.tl.info.get(n.name)
        return info is not None and info.reach is not None

    def includable(self, n: fx.Node) -> bool:
        if n in self.claimed or n in self.covered or n is self.h:
            return False
        if n.op == "get_attr":
            return True
        if n.op != "call_function":
            return False
        info = self.tl.info.get(n.name)
        if info is None:
            return False
        timed_in = any(self.timed(a) for a in n.all_input_nodes)
        if not info.time_dims:
            return not timed_in or n.target in METADATA_ONLY
        if self.position_constant(n):
            return False  # computed once outside, sliced per shard like any region input
        local = info.local
        if local is None:
            return True
        return not (math.isinf(local.lo) or math.isinf(local.hi))

    def position_constant(self, n: fx.Node) -> bool:
        """Whether ``n`` carries the time axis but reads no time-carrying graph input and differs
        between positions (positions built from ``arange``, a mask of the first step): a shard
        cannot rebuild it from its own steps, so it enters the region as an input, sliced."""
        info = self.tl.info.get(n.name)
        return (n.op == "call_function" and n.target not in METADATA_ONLY and info is not None
                and bool(info.time_dims) and info.reach is None and not self.uniform(n))

    def sliced(self, x: fx.Node) -> bool:
        """Whether region input ``x`` is sliced along time per shard."""
        return self.timed(x) or self.position_constant(x)

    def producer_closure(self, seeds: list[fx.Node], region: set[fx.Node]) -> set[fx.Node]:
        """Nodes feeding ``seeds`` whose live users all lie in the region (one reverse sweep)."""
        P: set[fx.Node] = set()
        needed: set[fx.Node] = set(seeds)
        for r in region:
            needed.update(r.all_input_nodes)
        inside = lambda x: x in P or x in region  # noqa: E731
        # reverse graph order over candidates, growing `needed` as nodes join
        for n in reversed(list(self.gm.graph.nodes)):
            if n not in needed or inside(n):
                continue
            if not self.includable(n):
                continue
            users = live_users(n, self.live)
            if users and all(inside(x) for x in users):
                P.add(n)
                needed.update(n.all_input_nodes)
        # `getitem` of a multi-output op left outside (a split whose other pieces feed layers
        # elsewhere, e.g. Mamba-2's `z, xBC, dt = split(in_proj(u))`): the piece itself is the
        # region input, not the tuple-valued op (which has no time dims to slice per shard)
        outside_pieces = {n for n in P if n.target is operator.getitem and isinstance(n.args[0], fx.Node)
                          and isinstance(n.args[0].target, torch._ops.OpOverload)
                          and n.args[0] not in P and n.args[0] not in region}
        return P - outside_pieces

    # ------------------------------------------------------------------ readout

    def state_classes(self, inputs: list[fx.Node]) -> set[int]:
        tcls = self.tl.time_class
        h_cls = set().union(*_classes(self.tl, self.h)) if _classes(self.tl, self.h) else set()
        x_cls: set[int] = set()
        for x in inputs:
            if self.timed(x) and _time_dim(self.tl, x, "region input") is not None:
                for c in _classes(self.tl, x):
                    x_cls |= c
        return h_cls - x_cls - {tcls}

    def is_open(self, n: fx.Node, state: set[int]) -> bool:
        if not isinstance(n.meta.get("val"), torch.Tensor):
            return True  # a multi-output op: its getitems decide
        if any(c & state for c in _classes(self.tl, n)):
            return True
        return any(f is not None and f.kind == "scale" for f in self.facts.get(n.name, ()))

    def is_final_select(self, n: fx.Node) -> bool:
        if n.target is not aten.select.int or n.args[0] is not self.h:
            return False
        v = _val(self.h)
        d = n.args[1] % v.dim()
        return d == self.site.time_dim and int(n.args[2]) in (-1, int(v.shape[d]) - 1)

    def contracted_by_einsum(self) -> bool:
        """Whether an ``einsum`` consumer of ``h`` sums over one of h's dims (SSD's readout
        ``einsum("blhpn,blhn->blhp", h, C)``): h then carries a state dim even where the dims
        analysis gave it no class of its own (x and B, split from one projection, share one)."""
        for user in self.h.users:
            if user.op != "call_function" or user.target is not aten.einsum.default:
                continue
            eq, ops = str(user.args[0]).replace(" ", ""), user.args[1]
            lhs, _, rhs = eq.partition("->")
            specs = lhs.split(",")
            if "..." in eq or len(specs) != len(ops) or not rhs:
                continue
            for spec, op in zip(specs, ops):
                if op is self.h and any(c not in rhs for c in spec):
                    return True
        return False

    def readout_closure(self, state: set[int]) -> tuple[list[fx.Node], Optional[fx.Node]]:
        R: list[fx.Node] = []
        Rset: set[fx.Node] = set()
        open_set = {self.h} if self.is_open(self.h, state) or self.contracted_by_einsum() else set()
        final: Optional[fx.Node] = None
        desc = self.descendants(self.h)
        for n in self.gm.graph.nodes:
            if self.order[n] <= self.order[self.h] or n not in self.live or n in self.covered:
                continue
            if n.op == "output":
                continue
            if self.is_final_select(n):
                final = n
                continue
            if not any(a in open_set for a in n.all_input_nodes):
                continue
            info = self.tl.info.get(n.name)
            local = info.local if info is not None else None
            if n.op != "call_function" or info is None or not info.time_dims or local is None or not local.is_pointwise:
                raise node_error(n, "the recurrence's state sequence (or its readout before the state dims are "
                                 "contracted) is used by an op that is not pointwise in time; the adjoint plans "
                                 "recompute the state shard by shard and need every use of h_t to read step t only",
                                 _INSTEAD)
            others = [a for a in n.all_input_nodes if a not in Rset and a is not self.h]
            bad = [a for a in others if a in desc]
            if bad:
                raise node_error(n, f"the readout combines the state with `{bad[0].name}`, another value computed "
                                 "from the same state outside the readout", _INSTEAD)
            R.append(n)
            Rset.add(n)
            if self.is_open(n, state):
                open_set.add(n)
        return R, final

    def readout_extension(self, R: list[fx.Node], final: Optional[fx.Node], scan_seeds: list[fx.Node],
                          base: set[fx.Node]) -> list[fx.Node]:
        """Pointwise-in-time nodes after the readout that the region takes in as well, when the
        layer then crosses its boundary in fewer bytes per step.

        A readout ends where the state dims are contracted, but the layer often goes on,
        position by position, to something narrower: Mamba's ``y + D x``, gate ``y * silu(z)``,
        norm and ``out_proj`` map ``heads x head_dim`` channels to the model width. Left outside,
        the contracted readout is a region output the next segment keeps for its backward (and
        ``z``, ``x`` are region inputs); taken in, each backward shard recomputes them from the
        region's inputs. Candidates are taken in graph order (each prefix is closed under
        inputs); the prefix whose region inputs and outputs carry the fewest bytes per step is
        kept, the shortest on a tie, none unless it is strictly fewer -- except that on a tie a
        prefix ending in the residual add (``x + f(x)``, ``x`` a region input of the output's
        shape) is preferred: the backward can then write ``x``'s gradient into the output's
        (:mod:`gradshard.plans.adjoint.donate`), one residual-stream buffer instead of two.
        """
        desc = self.descendants(self.h)
        inside = set(base) | set(R) | ({final} if final is not None else set())
        cands: list[fx.Node] = []
        for n in self.gm.graph.nodes:
            if len(cands) >= MAX_READOUT_EXTENSION:
                break
            if self.order[n] <= self.order[self.h] or n in inside or n not in self.live:
                continue
            if n.op != "call_function" or n in self.claimed or not any(a in inside for a in n.all_input_nodes):
                continue
            info = self.tl.info.get(n.name)
            local = info.local if info is not None else None
            if info is None or not info.time_dims or local is None or not local.is_pointwise:
                continue
            if any(a in desc and a not in inside for a in n.all_input_nodes):
                continue  # combines with another value computed from the state
            cands.append(n)
            inside.add(n)
        if not cands:
            return []
        costs = [self.boundary_bytes(R + cands[:k], final, scan_seeds, base) for k in range(len(cands) + 1)]
        joins = [k > 0 and self.joins_residual(cands[k - 1], R + cands[:k], final, scan_seeds, base)
                 for k in range(len(cands) + 1)]
        best = min(range(len(costs)), key=lambda k: (costs[k], not joins[k], k))
        return cands[:best] if costs[best] < costs[0] or (costs[best] == costs[0] and joins[best]) else []

    def joins_residual(self, n: fx.Node, R: list[fx.Node], final: Optional[fx.Node], scan_seeds: list[fx.Node],
                       base: set[fx.Node]) -> bool:
        """``n`` adds a time-carrying region input of its own shape and dtype (the residual stream)
        to a value of the region with readout ``R``."""
        if n.target != aten.add.Tensor or n.kwargs.get("alpha", 1) != 1:
            return False
        _, _, _, inputs, _ = self.layout(R, final, scan_seeds, base)
        v = _val(n)
        return v is not None and any(
            a in inputs and self.timed(a) and _val(a) is not None and _val(a).shape == v.shape and _val(a).dtype == v.dtype
            for a in n.args if isinstance(a, fx.Node))

    def layout(self, R: list[fx.Node], final: Optional[fx.Node], scan_seeds: list[fx.Node], base: set[fx.Node],
               ) -> tuple[list[fx.Node], list[fx.Node], set[fx.Node], list[fx.Node], list[fx.Node]]:
        """The region around readout ``R``: ``(extra, seeds, producers, inputs, exits)`` -- the
        readout's other inputs (producer outputs), what the producers compute, the producers,
        the region inputs, and the readout values (or ``h``) used outside."""
        rset = set(R)
        extra = list(dict.fromkeys(a for n in R for a in n.all_input_nodes
                                   if a not in rset and a is not self.h and a.op != "get_attr"))
        region = base | rset | ({final} if final is not None else set())
        seeds = scan_seeds + extra
        P = self.producer_closure(seeds, region)
        members = P | region
        inputs = self.inputs_of(members - ({final} if final else set()), members, seeds)
        exits = [n for n in [self.h, *R] if any(u not in members for u in live_users(n, self.live))]
        return extra, seeds, P, inputs, exits

    def boundary_bytes(self, R: list[fx.Node], final: Optional[fx.Node], scan_seeds: list[fx.Node],
                       base: set[fx.Node]) -> float:
        """Bytes the region with readout ``R`` reads and writes per time step (its time-carrying
        inputs and outputs); infinite where an output has no plain time axis."""
        _, _, _, inputs, exits = self.layout(R, final, scan_seeds, base)
        if not exits:
            return math.inf
        T = max(1, self.tl.seq_len)
        total = 0.0
        for n in exits:
            info = self.tl.info.get(n.name)
            if info is None or len(info.time_dims) != 1 or _val(n) is None:
                return math.inf
            d = info.time_dims[0]
            f = self.facts.get(n.name, ())
            if d >= len(f) or f[d] is None or f[d].kind != "shift":
                return math.inf
            total += tensor_bytes(_val(n)) / T
        for x in inputs:
            if self.timed(x) and _val(x) is not None:
                total += tensor_bytes(_val(x)) / T
        return total

    def descendants(self, root: fx.Node) -> set[fx.Node]:
        out: set[fx.Node] = set()
        stack = [root]
        while stack:
            n = stack.pop()
            for u in n.users:
                if u not in out:
                    out.add(u)
                    stack.append(u)
        return out

    # ------------------------------------------------------------------ locality of producers

    def locate(self, P: list[fx.Node], inputs: list[fx.Node], seeds: list[fx.Node]) -> tuple[int, int]:
        loc: dict[fx.Node, Optional[_Loc]] = {}
        T = self.tl.seq_len
        for x in inputs:
            d = _time_dim(self.tl, x, "region input") if self.sliced(x) else None
            if d is None:
                loc[x] = None
                continue
            f = self.facts.get(x.name, ())
            if d >= len(f) or f[d] is None or f[d].kind != "shift" or f[d].value != 0:
                raise node_error(x, "a region input's time axis is not the full sequence (merged with another dim, "
                                 "padded or cropped); gradshard slices region inputs per shard", _INSTEAD)
            loc[x] = _Loc(0, 0, 0, 0)
        for n in P:
            loc[n] = self.local_rule(n, loc, T)
        lh = rh = 0
        for s in seeds:
            if s is None or s not in loc or loc[s] is None:
                continue
            l = loc[s]
            lh = max(lh, int(-min(l.lo, 0)), l.bs)
            rh = max(rh, int(max(l.hi, 0)), l.be)
        return lh, rh

    def local_rule(self, n: fx.Node, loc: dict, T: int) -> Optional[_Loc]:
        info = self.tl.info[n.name] if n.name in self.tl.info else None
        ins = [loc[a] for a in n.all_input_nodes if loc.get(a) is not None]
        has_time = bool(info and info.time_dims)
        if not ins:
            if has_time and not self.uniform(n):
                raise node_error(n, "a producer of the recurrence builds a position-dependent constant along time "
                                 "(e.g. arange positions or a mask); recomputing a shard would shift it",
                                 "pass positions in as an input computed outside the layer, or " + _INSTEAD)
            return None
        if not has_time:
            if n.target in METADATA_ONLY:
                return None
            raise node_error(n, "a producer of the recurrence reduces over time", _INSTEAD)
        base = ins[0]
        for x in ins[1:]:
            base = base.join(x)
        t = n.target
        src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        src_td = _time_dim(self.tl, src, "producer input") if src is not None and self.timed(src) else None
        if t is aten.slice.Tensor and src_td is not None and (n.args[1] if len(n.args) > 1 else 0) % _val(src).dim() == src_td:
            return self.slice_rule(n, loc[src], src_td)
        if t is aten.cat.default:
            return self.cat_rule(n, loc)
        if t in (aten.constant_pad_nd.default, aten.pad.default) and src_td is not None:
            pads = list(n.args[1])
            k = _val(src).dim() - 1 - src_td
            left = pads[2 * k] if 2 * k < len(pads) else 0
            right = pads[2 * k + 1] if 2 * k + 1 < len(pads) else 0
            l = loc[src]
            return _Loc(l.lo - left, l.hi - left, max(0, l.bs + left), max(0, l.be + right))
        if t in (aten.conv1d.default, aten.convolution.default) and src_td is not None and src_td == _val(src).dim() - 1:
            w = _val(n.args[1])
            k = int(w.shape[-1]) if w is not None else 1
            pick = lambda v: v[-1] if isinstance(v, (list, tuple)) else v  # noqa: E731
            if t is aten.conv1d.default:
                stride = pick(n.args[3]) if len(n.args) > 3 else 1
                pad = pick(n.args[4]) if len(n.args) > 4 else 0
                dil = pick(n.args[5]) if len(n.args) > 5 else 1
            else:
                stride, pad, dil = pick(n.args[3]), pick(n.args[4]), pick(n.args[5])
            if isinstance(pad, str) or stride != 1:
                raise node_error(n, "a strided or 'same'-padded convolution along time in the producers", _INSTEAD)
            l = base
            return _Loc(l.lo - pad, l.hi - pad + dil * (k - 1), l.bs + pad, l.be + pad)
        local = info.local
        if local is None or local.is_pointwise:
            return base
        raise node_error(n, f"a producer of the recurrence reads along time in a way gradshard cannot shard "
                         f"({local}, {info.why})", _INSTEAD)

    def slice_rule(self, n: fx.Node, l: _Loc, d: int) -> _Loc:
        args = list(n.args) + [None] * (5 - len(n.args))
        length = int(_val(n.args[0]).shape[d])
        start, end, step = args[2], args[3], args[4]
        if step not in (None, 1):
            raise node_error(n, "a strided slice along time in the producers", _INSTEAD)
        start = 0 if start is None else (start + length if start < 0 else start)
        end = length if end is None or end > length else (end + length if end < 0 else end)
        f = self.facts.get(n.name, ())
        fact = f[d] if d < len(f) else None
        out_len = max(0, end - start)
        if fact is not None and fact.kind == "fixed":
            if 2 * start < length:  # a short piece at the start: all of it is boundary
                return _Loc(l.lo + start, l.hi + start, out_len, 0)
            return _Loc(l.lo + start, l.hi + start, 0, out_len)
        return _Loc(l.lo + start, l.hi + start, max(0, l.bs - start), max(0, l.be - (length - end)))

    def cat_rule(self, n: fx.Node, loc: dict) -> _Loc:
        pieces = list(n.args[0])
        out = _val(n)
        dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % out.dim()
        td = _time_dim(self.tl, n, "producer")
        if td != dim:
            res = None
            for p in pieces:
                if isinstance(p, fx.Node) and loc.get(p) is not None:
                    res = loc[p] if res is None else res.join(loc[p])
            return res
        bulk = [i for i, p in enumerate(pieces) if isinstance(p, fx.Node)
                and (self.facts.get(p.name, ()) + (None,) * 99)[dim] is not None
                and self.facts[p.name][dim].kind == "shift"]
        if len(bulk) != 1:
            raise node_error(n, "a concatenation along time whose pieces do not scale with the sequence", _INSTEAD)
        b = bulk[0]
        offset = sum(int(_val(p).shape[dim]) for p in pieces[:b])
        after = sum(int(_val(p).shape[dim]) for p in pieces[b + 1:])
        lb = loc.get(pieces[b]) or _Loc(0, 0, 0, 0)
        res = _Loc(lb.lo - offset, lb.hi - offset, offset + lb.bs, after + lb.be)
        pos = 0
        for p in pieces:
            size = int(_val(p).shape[dim])
            if p is not pieces[b] and loc.get(p) is not None:
                lp = loc[p]
                res = res.join(_Loc(lp.lo - pos, lp.hi - pos, 0, 0))
            pos += size
        return res

    def uniform(self, n: fx.Node) -> bool:
        """Whether ``n`` (built without time-carrying inputs) is the same at every position."""
        if n.op == "placeholder":
            return not (self.tl.info.get(n.name) and self.tl.info[n.name].time_dims)
        if n.op == "get_attr":
            info = self.tl.info.get(n.name)
            return not (info and info.time_dims)
        if n.op != "call_function" or n.target not in _UNIFORM:
            return False
        return all(self.uniform(a) or not (self.tl.info.get(a.name) and self.tl.info[a.name].time_dims)
                   for a in n.all_input_nodes)

    # ------------------------------------------------------------------ main

    def run(self) -> "RegionPlan":
        site = self.site
        if site.reverse:
            raise node_error(self.h, "a reverse-time (anti-causal) scan", "use plan='seco' or plan='none' for this layer")
        scan_seeds = [x for x in (self.a, self.u, self.h0) if x is not None]
        base_region = set(self.covered) | {self.h}
        pre = self.producer_closure(scan_seeds, base_region)
        pre_inputs = self.inputs_of(pre | base_region, pre | base_region, scan_seeds)
        state = self.state_classes(pre_inputs)
        R, final = self.readout_closure(state)
        taken = self.readout_extension(R, final, scan_seeds, base_region) if self.extend else []
        R = R + taken
        extra, seeds, P, inputs, exits = self.layout(R, final, scan_seeds, base_region)
        P_list = sorted(P, key=self.order.get)
        lh, rh = self.locate(P_list, inputs, seeds)
        if not exits and final is None:
            raise node_error(self.h, "the recurrence's output is never used", "remove it")
        T = self.tl.seq_len
        td = site.time_dim
        uv, av = _val(self.u), _val(self.a) if self.a is not None else None
        rank = uv.dim()
        if av is not None:
            if av.dim() > rank:
                raise node_error(self.a, "the decay has more dims than the scanned input", _INSTEAD)
            ad = _time_dim(self.tl, self.a, "decay") if self.timed(self.a) else None
            if ad is not None and ad + rank - av.dim() != td:
                raise node_error(self.a, "the decay's time axis does not line up with the input's", _INSTEAD)
        if self.h0 is not None and self.timed(self.h0) and _time_dim(self.tl, self.h0, "initial state") is not None:
            raise node_error(self.h0, "the initial state carries the time axis", _INSTEAD)
        prod_out = [self.a, self.u, self.h0, *extra]
        prod_td = tuple(None if x is None or not self.timed(x) else _time_dim(self.tl, x, "producer output")
                        for x in prod_out)
        out_td = tuple(_time_dim(self.tl, x, "region output") for x in exits)
        for x, d in zip(exits, out_td):
            f = self.facts.get(x.name, ())
            if d is None or f[d] is None or f[d].kind != "shift":
                raise node_error(x, "a region output without a plain time axis", _INSTEAD)
        merged: list[Optional[tuple[int, int]]] = []
        for x, d in zip(prod_out, prod_td):
            m = None
            f = self.facts.get(x.name, ()) if x is not None and d is not None else ()
            if f and (lh or rh) and (f[d] is None or f[d].kind != "shift"):
                m = _merged_time(self.tl, x, d)
                if m is None:
                    raise node_error(x, "a producer value with time merged into another dim needs a halo", _INSTEAD)
            merged.append(m)
        in_td = tuple(_time_dim(self.tl, x, "region input") if self.sliced(x) else None for x in inputs)
        if all(d is None for d in in_td):
            raise node_error(self.h, "no region input carries the time axis", _INSTEAD)
        io = RegionIO(in_td, prod_td, out_td, final is not None, (lh, rh), T, tuple(merged))
        scan = ScanSpec(site.kind, self.a is not None, self.h0 is not None, td, rank)
        plan = RegionPlan(site, P_list, R, inputs, prod_out, exits, final, scan, io, extended=len(taken))
        plan.covered_nodes = sorted(self.covered, key=self.order.get)
        return plan

    def inputs_of(self, consumers: set[fx.Node], members: set[fx.Node], seeds: list[fx.Node]) -> list[fx.Node]:
        ins: list[fx.Node] = []
        for n in sorted(consumers, key=self.order.get):
            if n in self.covered and n is not self.h:
                continue
            if n is self.h and n in self.covered:
                continue
            for a in n.all_input_nodes:
                if a not in members and a not in ins and a.op != "get_attr":
                    ins.append(a)
        for s in seeds:
            if s not in members and s not in ins:
                ins.append(s)
        return sorted(ins, key=self.order.get)


def extract_region(gm: fx.GraphModule, tl: Any, facts: dict, site: ScanSite, live: set[fx.Node],
                   claimed: set[fx.Node], extend: bool = True) -> RegionPlan:
    """Cut the region of ``site`` out of ``gm`` (pure; see the module doc); ``extend``: take in the
    pointwise nodes after the readout where that narrows the region's boundary."""
    return _Extractor(gm, tl, facts, site, live, claimed, extend).run()
