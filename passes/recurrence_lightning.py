"""Rewrite blockwise ("lightning") linear attention as ``gradshard::linear_scan`` and a readout.

Lightning attention (TransNormerLLM, MiniMax-01's linear layers) is causal linear attention
with a constant decay ``λ`` per head::

    kv_t = λ kv_{t-1} + k_t^T v_t,        o_t = q_t kv_t

computed block by block in a Python loop: per block ``b`` an intra-block product
``((q_b k_b^T) ⊙ M) v_b`` with the decay mask ``M[i, j] = λ^(i-j)`` (``i >= j``, else 0), an
inter-block term ``(q_b ⊙ λ^i) kv`` and the carried state ``kv = λ^L kv + (k_b ⊙ λ^(L-j))^T
v_b``; the block outputs are concatenated along time. Unrolled by tracing, no analysis can
follow time through the blocks (the block product reads steps past the diagonal, masked only
by the values of ``M``), so plans refuse the layer. This pass finds such a region from its
structure and proves what it computes::

    region:  q, k, v (full length) --slice at block bounds--> per-block products, carried
             state --cat(block outputs, time)--> o
    after:   h = linear_scan(λ.reshape(1, 1, H, 1, 1), k[..., :, None] * v[..., None, :])
             o = einsum("bthk,bthkv->bthv", q, h)     (each layout permuted to (B, T, H, d) and back)

A region is every node between slices that cut full-length tensors at the block bounds of
one ``cat`` and that ``cat``: three sources (q, k, v), every other input computed from
grad-free parameters, buffers and constants only, and no block value used outside. Which
source plays q, k or v, and where ``λ`` is read -- the ``(1, 0)`` entry of a decay mask
``λ^(i-j)``, or a per-head vector holding ``λ`` or ``log λ`` -- is found by evaluating the
region on random inputs and comparing it with the reference kernel for every assignment;
nothing is rewritten unless one matches. ``λ`` is read from its graph node at run time (the
buffer behind it stays an input), not baked into the graph.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.analysis.dims import shape_of
from gradshard.pipeline import ancestors, descendants

from gradshard.passes.linear_attention_spec import TensorLayout, layout_for
from gradshard.passes.recurrence_graph import emit_node, live_nodes
from gradshard.passes.region_proof import (
    MAX_EVAL_ELEMENTS, constant_value, exact_arithmetic, grad_free_constant, is_data, proof_tolerance, region_subgraph,
    to_f64)

aten = torch.ops.aten

__all__ = ["BlockedAttention", "DecayRead", "match_blocked_attention", "rewrite_blocked_attention"]

_MAX_CANDIDATES = 24
_CANDIDATE_DEPTH = 8


@dataclass(frozen=True)
class DecayRead:
    """Where ``λ`` (one per head, or one for all heads) is read: ``kind`` ``mask`` (``M[..., 1, 0]``
    of a ``λ^(i-j)`` mask), ``vector`` (a node holding ``λ``, or ``log λ`` when ``exp``) or ``none``
    (``λ = 1``)."""

    kind: str
    node: Optional[fx.Node] = None
    exp: bool = False

    def value(self, src: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``λ`` flattened to ``(n,)``, ``n`` 1 or the head count (None: no decay)."""
        if self.kind == "none" or src is None:
            return None
        x = src
        if self.kind == "mask":  # (..., rows, n): the leading dims repeat λ (a mask expanded over the batch)
            x = src[..., 1, 0]
            x = x.reshape(-1, x.shape[-1])[0] if x.dim() else x
        x = x.reshape(-1)
        return torch.exp(x) if self.exp else x

    def describe(self) -> str:
        if self.kind == "none":
            return "no decay"
        where = f"M[..., 1, 0] of {self.node.name}" if self.kind == "mask" else self.node.name
        return f"λ = exp({where})" if self.exp else f"λ = {where}"


@dataclass(frozen=True)
class BlockedAttention:
    """A proven blockwise linear-attention region: q, k, v with their layouts, λ, the exit ``cat``."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    layouts: tuple[TensorLayout, TensorLayout, TensorLayout]
    out_layout: TensorLayout
    decay: DecayRead
    exit: fx.Node
    nodes: frozenset[fx.Node]
    blocks: int


# --------------------------------------------------------------------------- structure


def _block_slice(node: fx.Node) -> Optional[tuple[fx.Node, int, int, int]]:
    """``(source, dim, start, stop)`` of a unit-step ``slice`` node (bounds clamped), else None."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor or not isinstance(node.args[0], fx.Node):
        return None
    shp = shape_of(node.args[0])
    if not shp:
        return None
    args = list(node.args) + [None] * (5 - len(node.args))
    dim = node.kwargs.get("dim", args[1] if args[1] is not None else 0)
    start = node.kwargs.get("start", args[2])
    end = node.kwargs.get("end", args[3])
    step = node.kwargs.get("step", args[4] if args[4] is not None else 1)
    if step != 1 or not all(isinstance(x, int) or x is None for x in (dim, start, end)):
        return None
    dim %= len(shp)
    size = shp[dim]

    def clamp(x: Optional[int], default: int) -> int:
        if x is None:
            return default
        return min(max(x + size if x < 0 else x, 0), size)

    return node.args[0], dim, clamp(start, 0), clamp(end, size)


def _cat_blocks(node: fx.Node) -> Optional[tuple[int, tuple[tuple[int, int], ...]]]:
    """``(dim, block bounds)`` of a ``cat`` of at least two pieces, else None."""
    if node.op != "call_function" or node.target is not aten.cat.default:
        return None
    pieces = node.args[0]
    shp = shape_of(node)
    if not shp or not isinstance(pieces, (list, tuple)) or len(pieces) < 2:
        return None
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(shp)
    bounds, at = [], 0
    for p in pieces:
        ps = shape_of(p) if isinstance(p, fx.Node) else None
        if ps is None or len(ps) != len(shp) or ps[dim] < 1:
            return None
        bounds.append((at, at + ps[dim]))
        at += ps[dim]
    return dim, tuple(bounds)


@dataclass(frozen=True)
class _Region:
    sources: tuple[fx.Node, ...]
    source_dims: tuple[int, ...]
    nodes: frozenset[fx.Node]
    consts: tuple[fx.Node, ...]  # inputs of the region computed from grad-free constants


def _region_of(cat: fx.Node, live: set[fx.Node], values: dict[str, Any]) -> Optional[_Region]:
    """The nodes between block slices of full-length sources and ``cat`` (see module doc)."""
    blocks = _cat_blocks(cat)
    if blocks is None:
        return None
    _, bounds = blocks
    length = bounds[-1][1]
    above = ancestors([cat])
    entries: dict[fx.Node, list[fx.Node]] = {}
    dims: dict[fx.Node, int] = {}
    for n in (n for n in cat.graph.nodes if n in above):  # graph order: deterministic
        sl = _block_slice(n)
        if sl is None:
            continue
        src, dim, start, stop = sl
        if shape_of(src)[dim] != length or (start, stop) not in bounds or dims.get(src, dim) != dim:
            continue
        dims[src] = dim
        entries.setdefault(src, []).append(n)
    # a constant cut into the same blocks (a decay table expanded over time) is a constant input
    sources = [s for s in entries if {_block_slice(e)[2:] for e in entries[s]} == set(bounds)
               and not grad_free_constant(s, values)]
    below = {s: descendants(entries[s], above.__contains__) for s in sources}
    # an earlier layer cut into the same blocks feeds this layer's sources: not part of this region
    sources = [s for s in sources if not any(o in below[s] for o in sources if o is not s)]
    if len(sources) != 3:
        return None
    order = {n: i for i, n in enumerate(cat.graph.nodes)}
    sources.sort(key=order.__getitem__)
    first = [e for s in sources for e in entries[s]]
    nodes = set().union(*(below[s] for s in sources))
    if cat not in nodes:
        return None
    for n in nodes - {cat}:
        if any(u not in nodes for u in n.users if u in live):
            return None  # a block value leaves the region another way (e.g. the final state)
    entry_set = set(first)
    consts: list[fx.Node] = []
    for n in sorted(nodes, key=order.__getitem__):
        for a in n.all_input_nodes:
            if a in nodes or (n in entry_set and a is n.args[0]) or a in consts:
                continue
            if not grad_free_constant(a, values):
                return None
            consts.append(a)
    return _Region(tuple(sources), tuple(dims[s] for s in sources), frozenset(nodes), tuple(consts))


# --------------------------------------------------------------------------- proof


def _decay_candidates(region: _Region, const_values: dict[fx.Node, torch.Tensor],
                      known: dict[str, torch.Tensor], heads: int) -> list[tuple[DecayRead, torch.Tensor]]:
    """Constant nodes (nearest the region first) that could hold ``λ``, with their ``λ`` values."""
    out: list[tuple[DecayRead, torch.Tensor]] = []
    seen: set[fx.Node] = set()
    memo: dict[fx.Node, Any] = {}
    frontier = list(region.consts)
    for _ in range(_CANDIDATE_DEPTH):
        nxt: list[fx.Node] = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            nxt.extend(n.all_input_nodes)
            val = const_values.get(n)
            if val is None:
                val = constant_value(n, known, memo)
            if not isinstance(val, torch.Tensor) or not val.is_floating_point():
                continue
            reads = []
            if val.dim() >= 2 and val.shape[-1] == val.shape[-2] >= 2:
                reads.append(DecayRead("mask", n))
            if val.numel() in (1, heads):
                reads += [DecayRead("vector", n), DecayRead("vector", n, exp=True)]
            for read in reads:
                lam = read.value(val.detach().to(torch.float64))
                if lam.numel() not in (1, heads) or not torch.isfinite(lam).all():
                    continue
                if any(lam.shape == o.shape and torch.equal(lam, o) for _, o in out):
                    continue
                out.append((read, lam))
        frontier = nxt
        if len(out) >= _MAX_CANDIDATES:
            break
    return out[:_MAX_CANDIDATES]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: Optional[torch.Tensor],
               heads: int) -> torch.Tensor:
    from gradshard.kernels import lightning_attention

    f64 = torch.float64
    decay = None if lam is None else lam.to(f64).expand(heads).contiguous()
    o, _ = lightning_attention(q.to(f64), k.to(f64), v.to(f64), decay, chunk_size=64, backend="torch")
    return o


def _canonical_shape(shape: tuple[int, ...], layout: TensorLayout) -> tuple[int, ...]:
    s = tuple(shape[p] for p in layout.perm)
    return (s[0], 1, *s[1:]) if layout.rank == 3 else s


def _prove(gm: fx.GraphModule, region: _Region, cat: fx.Node,
           known: dict[str, torch.Tensor]) -> Optional[tuple[tuple[int, int, int], DecayRead, int]]:
    """``((iq, ik, iv), λ read, heads)`` for which the region equals the reference, or None."""
    out_shape = shape_of(cat)
    out_layout = layout_for(out_shape, _cat_blocks(cat)[0])
    layouts = [layout_for(shape_of(s), d) for s, d in zip(region.sources, region.source_dims)]
    if out_layout is None or any(x is None for x in layouts):
        return None
    const_values: dict[fx.Node, torch.Tensor] = {}
    memo: dict[fx.Node, Any] = {}
    for c in region.consts:
        val = constant_value(c, known, memo)
        if val is None:
            return None
        const_values[c] = val
    if not all(s.meta["val"].is_floating_point() for s in region.sources):
        return None
    if sum(math.prod(shape_of(n) or (0,)) for n in region.nodes) > MAX_EVAL_ELEMENTS:
        return None
    tol = proof_tolerance(const_values.values())
    if tol is None:
        return None
    gen = torch.Generator().manual_seed(20260216)
    src_vals = [torch.randn(shape_of(s), generator=gen, dtype=torch.float64).div(math.sqrt(shape_of(s)[-1]))
                for s in region.sources]
    try:
        with exact_arithmetic():  # in float64: the proof does not depend on the model's dtype or casts
            run = region_subgraph(gm, (*region.sources, *region.consts), region.nodes, cat)
            got = run(*src_vals, *[to_f64(const_values[c]) for c in region.consts])
    except Exception:  # noqa: BLE001 - a region that does not run on its own is not claimed
        return None
    if not isinstance(got, torch.Tensor) or got.shape != torch.Size(out_shape) or not torch.isfinite(got).all():
        return None
    got = out_layout.to_canonical(got)
    o_canon = _canonical_shape(out_shape, out_layout)
    candidates: dict[int, list[tuple[DecayRead, Optional[torch.Tensor]]]] = {}
    for iq, ik, iv in itertools.permutations(range(3)):
        qc, kc, vc = (_canonical_shape(shape_of(region.sources[i]), layouts[i]) for i in (iq, ik, iv))
        if qc != kc or qc[:3] != vc[:3] or vc != o_canon:
            continue
        heads = qc[1]
        q, k, v = (layouts[i].to_canonical(src_vals[i]) for i in (iq, ik, iv))
        if heads not in candidates:
            candidates[heads] = [*_decay_candidates(region, const_values, known, heads), (DecayRead("none"), None)]
        for read, lam in candidates[heads]:
            want = _reference(q, k, v, lam, heads)
            scale = float(want.abs().max())
            if scale > 0 and float((got - want).abs().max()) <= tol * scale:
                return (iq, ik, iv), read, heads
    return None


def match_blocked_attention(gm: fx.GraphModule, values: dict[str, Any]) -> list[BlockedAttention]:
    """Every proven blockwise linear-attention region of ``gm`` (see the module doc).

    ``values``: placeholder name -> example value (parameters and buffers are read from it).
    """
    live = live_nodes(gm)
    known = {n: v for n, v in values.items() if isinstance(v, torch.Tensor) and not v.requires_grad}
    data = {p.name for p in gm.graph.find_nodes(op="placeholder") if is_data(p)}
    known = {n: v for n, v in known.items() if n not in data}
    cut: dict[tuple[int, int, int], set[fx.Node]] = {}  # (length, start, stop) -> tensors sliced so
    for n in gm.graph.nodes:
        sl = _block_slice(n)
        if sl is not None:
            cut.setdefault((shape_of(sl[0])[sl[1]], sl[2], sl[3]), set()).add(sl[0])
    found: list[BlockedAttention] = []
    claimed: set[fx.Node] = set()
    for cat in list(gm.graph.nodes):
        blocks = _cat_blocks(cat) if cat in live and cat not in claimed else None
        if blocks is None:
            continue
        length = blocks[1][-1][1]  # cheap screen: three tensors cut at every block bound
        if len(set.intersection(*(cut.get((length, *b), set()) for b in blocks[1]))) < 3:
            continue
        region = _region_of(cat, live, values)
        if region is None or region.nodes & claimed:
            continue
        proof = _prove(gm, region, cat, known)
        if proof is None:
            continue
        (iq, ik, iv), read, _heads = proof
        layouts = [layout_for(shape_of(s), d) for s, d in zip(region.sources, region.source_dims)]
        found.append(BlockedAttention(
            region.sources[iq], region.sources[ik], region.sources[iv],
            (layouts[iq], layouts[ik], layouts[iv]), layout_for(shape_of(cat), _cat_blocks(cat)[0]),
            read, cat, region.nodes, len(_cat_blocks(cat)[1])))
        claimed |= region.nodes
    return found


# --------------------------------------------------------------------------- rewrite


def _to_bthd(graph: fx.Graph, x: fx.Node, layout: TensorLayout, trace: Any) -> fx.Node:
    """``x`` permuted to ``(B, T, H, d)`` (a rank-3 ``(B, T, d)`` gets ``H = 1``)."""
    p = layout.perm
    perm = [p[0], p[2], p[1], p[3]] if layout.rank == 4 else list(p)
    if perm != list(range(layout.rank)):
        x = emit_node(graph, aten.permute.default, (x, perm), trace)
    if layout.rank == 3:
        x = emit_node(graph, aten.unsqueeze.default, (x, 2), trace)
    return x


def _from_bthd(graph: fx.Graph, o: fx.Node, layout: TensorLayout, trace: Any) -> fx.Node:
    """Inverse of :func:`_to_bthd` for the output layout."""
    p = layout.perm
    if layout.rank == 3:
        o = emit_node(graph, aten.squeeze.dim, (o, 2), trace)
        order = list(p)
    else:
        order = [p[0], p[2], p[1], p[3]]  # dim j of o holds output dim order[j]
    inv = [order.index(i) for i in range(layout.rank)]
    if inv != list(range(layout.rank)):
        o = emit_node(graph, aten.permute.default, (o, inv), trace)
    return o


def _emit_decay(graph: fx.Graph, read: DecayRead, trace: Any) -> Optional[fx.Node]:
    """``λ`` as a ``(1, 1, n, 1, 1)`` node (broadcast over batch, time and the state)."""
    if read.kind == "none":
        return None
    x = read.node
    if read.kind == "mask":
        x = emit_node(graph, aten.select.int, (x, -2, 1), trace)
        x = emit_node(graph, aten.select.int, (x, -1, 0), trace)
        if x.meta["val"].dim() > 1:
            x = emit_node(graph, aten.reshape.default, (x, [-1, x.meta["val"].shape[-1]]), trace)
            x = emit_node(graph, aten.select.int, (x, 0, 0), trace)
    n = x.meta["val"].numel()
    x = emit_node(graph, aten.reshape.default, (x, [1, 1, n, 1, 1]), trace)
    return emit_node(graph, aten.exp.default, (x,), trace) if read.exp else x


def rewrite_blocked_attention(gm: fx.GraphModule, values: dict[str, Any]) -> list[str]:
    """Replace every proven blockwise linear-attention region by one scan and its readout."""
    notes = []
    for r in match_blocked_attention(gm, values):
        graph, trace = gm.graph, r.exit.meta.get("stack_trace")
        with graph.inserting_before(r.exit):
            q, k, v = (_to_bthd(graph, x, lay, trace) for x, lay in zip((r.q, r.k, r.v), r.layouts))
            u = emit_node(graph, aten.mul.Tensor, (emit_node(graph, aten.unsqueeze.default, (k, -1), trace),
                                                   emit_node(graph, aten.unsqueeze.default, (v, -2), trace)), trace)
            a = _emit_decay(graph, r.decay, trace)
            if a is None:
                a = emit_node(graph, aten.ones_like.default, (u,), trace)
            h = emit_node(graph, torch.ops.gradshard.linear_scan.default, (a, u, None, False, None), trace)
            h.meta["gs_written_as"] = "blockwise linear attention"
            o = emit_node(graph, aten.einsum.default, ("bthk,bthkv->bthv", [q, h]), trace)
            o = _from_bthd(graph, o, r.out_layout, trace)
            dtype = r.exit.meta["val"].dtype
            if o.meta["val"].dtype != dtype:
                o = emit_node(graph, aten.to.dtype, (o, dtype), trace)
        r.exit.replace_all_uses_with(o)
        notes.append(f"blockwise linear attention ({r.blocks} blocks, {len(r.nodes)} nodes, exit {r.exit.name}) "
                     f"-> {h.name} (q={r.q.name}, k={r.k.name}, v={r.v.name}, {r.decay.describe()})")
    if notes:
        gm.graph.eliminate_dead_code()
    return notes
