"""canonicalize_recurrences: rewrite every detected scan as one ``gradshard`` scan op node.

Vectorised scans come in many spellings (log-space cumsum, the ``associative_scan`` tree of
strided slices and stacks, a bare cumsum). This pass replaces each one found by
:func:`~gradshard.passes.detect_recurrence.find_scan_sites` with the same value computed by
``gradshard::linear_scan`` (diagonal) or ``gradshard::dense_linear_scan``, time moved to
dim 1 and back::

    before:  L = cumsum(log(a), 1); h = exp(L) * cumsum(u * exp(-L), 1)
    after:   h = linear_scan(a, u, None, False, None)

    before:  permute(a) -> [~50 nodes of odd/even slices, stacks, pads] -> slice_20
    after:   h = permute(linear_scan(permute(a'), permute(u'), None), ...)

    before:  u' = cat([u[:, :1] + a[:, :1] * h0.unsqueeze(1), u[:, 1:]], 1); h = scan(a, u')
    after:   h = linear_scan(a, u, h0, False, None)        (:mod:`.recurrence_fold`)

    before:  A = cumsum(log_a, 1); h = exp(A + logcumsumexp(log_u - A, 1))
    after:   h = linear_scan(exp(log_a), exp(log_u))       (:mod:`.recurrence_logspace`)

Later passes then see one scan node per recurrence, and the time analysis is recomputed on
a graph without the scan's internals (whose many equal-sized pieces can otherwise make
the dims analysis conflate the time axis with other axes of the same size). The numbers
computed are those of the recurrence (up to rounding, without the log-space overflow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from gradshard.analysis.locality import analyze_time_locality
from gradshard.pipeline import PassContext, PassResult, graph_pass

from gradshard.ops.dense_scan import is_scan_op
from gradshard.passes.detect_recurrence import ScanSite, find_scan_sites
from gradshard.passes.recurrence_lightning import rewrite_blocked_attention
from gradshard.passes.recurrence_ssd import rewrite_ssd_regions
from gradshard.passes.recurrence_fold import FoldedInitialState, emit_initial_state, match_folded_initial_state
from gradshard.passes.recurrence_graph import copy_graph_module, emit_node, live_nodes, time_from_dim1, time_to_dim1
from gradshard.passes.recurrence_logspace import rewrite_heinsen_scans
from gradshard.passes.recurrence_normalize import unmerge_matmuls

aten = torch.ops.aten

__all__ = ["canonicalize_recurrences"]


@dataclass(frozen=True)
class _Unfold:
    """An initial state folded into a site's input; ``perm``: the permute the site's ``u`` and ``a``
    read the folded value through (``associative_scan`` moves time first), ``a``/``time_dim`` before it."""

    fold: FoldedInitialState
    a: Optional[fx.Node]
    time_dim: int
    perm: Optional[list[int]]


def _fold_of(nodes: dict[str, fx.Node], site: ScanSite) -> Optional[_Unfold]:
    """The initial state folded into ``site``'s first input (a forward scan without ``h0``), or None."""
    if site.h0 is not None or site.reverse or site.u not in nodes or (site.a and site.a not in nodes):
        return None
    u, a, td = nodes[site.u], nodes[site.a] if site.a else None, site.time_dim
    fold = match_folded_initial_state(u, a, td, site.kind)
    if fold is not None:
        return _Unfold(fold, a, td, None)
    if u.target is not aten.permute.default or (a is not None and (
            a.target is not aten.permute.default or _perm(a) != _perm(u))):
        return None
    perm = _perm(u)
    inner_a = a.args[0] if a is not None else None
    fold = match_folded_initial_state(u.args[0], inner_a, perm[td], site.kind)
    return None if fold is None else _Unfold(fold, inner_a, perm[td], perm)


def _perm(n: fx.Node) -> list[int]:
    rank = n.meta["val"].dim()
    return [int(d) % rank for d in n.args[1]]


def _drop_shape_read(graph: fx.Graph, a: Optional[fx.Node], trace) -> Optional[fx.Node]:
    """``expand_as(x, y)`` as ``expand(x, shape)``: ``a`` must not keep the folded input alive."""
    if a is None or a.target is not aten.expand_as.default:
        return a
    return emit_node(graph, aten.expand.default, (a.args[0], list(a.meta["val"].shape)), trace)


def _unfold_scan_op(gm: fx.GraphModule, site: ScanSite, fold: FoldedInitialState) -> str:
    """Give a scan-op node the unfolded input and ``h0`` in place (keeps its backend and loop marks)."""
    h = next(n for n in gm.graph.nodes if n.name == site.h)
    trace = h.meta.get("stack_trace")
    with gm.graph.inserting_before(h):
        h0 = emit_initial_state(gm.graph, fold, tuple(fold.u.meta["val"].shape), site.time_dim, trace)
        a = _drop_shape_read(gm.graph, h.args[0], trace)
    args = list(h.args)
    args[0], args[1] = a, fold.u
    kwargs = dict(h.kwargs)
    if len(args) > 2:
        args[2] = h0
    else:
        kwargs["h0"] = h0
    h.args, h.kwargs = tuple(args), kwargs
    return f"{site.written_as} at {site.h}: initial state {h0.name} unfolded from its first input"


def _rewrite(gm: fx.GraphModule, site: ScanSite) -> str:
    nodes = {n.name: n for n in gm.graph.nodes}
    h = nodes[site.h]
    unfold = _fold_of(nodes, site)
    if unfold is not None and unfold.perm is None and len(site.covered) == 1 and is_scan_op(h):
        return _unfold_scan_op(gm, site, unfold.fold)
    u = unfold.fold.u if unfold is not None else nodes[site.u]
    a = unfold.a if unfold is not None else (nodes[site.a] if site.a else None)
    rank = u.meta["val"].dim()
    td = unfold.time_dim if unfold is not None else site.time_dim
    if rank < 2:
        return f"left {site.written_as} at {h.name} as is (1-d)"
    trace = h.meta.get("stack_trace")
    graph = gm.graph
    with graph.inserting_before(h):
        if unfold is not None:
            a = _drop_shape_read(graph, a, trace)
        u1 = time_to_dim1(graph, u, td, rank, trace)
        if a is None:
            # u-shaped (not broadcast) so the time analysis sees the scan's time axis on `a`
            a1 = emit_node(graph, aten.ones_like.default, (u1,), trace)
        else:
            a1 = time_to_dim1(graph, a, td, rank, trace)
        # state dims keep their order when time moves to dim 1, so h0 needs no permute
        h0 = None if unfold is None else emit_initial_state(graph, unfold.fold, tuple(u.meta["val"].shape), td, trace)
        if site.kind == "dense":
            scan = emit_node(graph, torch.ops.gradshard.dense_linear_scan.default, (a1, u1, h0), trace)
        else:
            scan = emit_node(graph, torch.ops.gradshard.linear_scan.default, (a1, u1, h0, False, None), trace)
        scan.meta["gs_written_as"] = site.written_as
        out = time_from_dim1(graph, scan, td, rank, trace)
        if unfold is not None and unfold.perm is not None:
            out = emit_node(graph, aten.permute.default, (out, unfold.perm), trace)
    if out.meta["val"].dtype != h.meta["val"].dtype:
        with graph.inserting_before(h):
            out = emit_node(graph, aten._to_copy.default, (out,), trace)
    h.replace_all_uses_with(out)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for name in sorted((c for c in site.covered if c in nodes), key=lambda x: -order[nodes[x]]):
        n = nodes[name]
        if not n.users:
            graph.erase_node(n)
    folded = f" (initial state {h0.name} unfolded from its first input)" if h0 is not None else ""
    return f"{site.written_as} at {site.h} -> {scan.name}{folded}"


@graph_pass
def canonicalize_recurrences(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite each vectorised scan as one gradshard scan-op node (see module doc)."""
    tl = ctx.analyses.get("time")
    if tl is None:
        return PassResult(gm, notes=("no time axis",))
    found = find_scan_sites(gm, tl)
    new = copy_graph_module(gm)
    new.graph.eliminate_dead_code()
    merged = unmerge_matmuls(new)
    # Before the other forms: a log-space scan's cumsum(log a) would otherwise be taken for a
    # scan of its own (a = 1); once rewritten, that cumsum is dead and its site is skipped.
    time_dims = {name: info.time_dims for name, info in tl.info.items()}
    # First: an SSD block region holds cumsums of its own that would be taken for scans.
    ssd = rewrite_ssd_regions(new, time_dims)
    heinsen = rewrite_heinsen_scans(new, time_dims)
    # Blockwise (lightning) linear attention: slices + carried block state + cat -> one scan.
    placeholders = new.graph.find_nodes(op="placeholder")
    blocked = rewrite_blocked_attention(new, {p.name: v for p, v in zip(placeholders, ctx.example_inputs or ())})
    nodes = {n.name: n for n in new.graph.nodes}
    sites = [s for s in found if s.h in nodes and (
        len(s.covered) > 1 or s.written_as == "cumsum" or _fold_of(nodes, s) is not None)]
    if not sites and not merged and not heinsen and not ssd and not blocked:
        return PassResult(gm, notes=("scans already canonical",))
    live = live_nodes(new)
    notes = [f"restored {merged} matmul(s) decomposed over merged batch*time rows"] if merged else []
    notes += ssd + heinsen + blocked
    for site in sites:
        if site.h not in {n.name for n in live}:
            continue
        notes.append(_rewrite(new, site))
    new.graph.eliminate_dead_code()
    new.graph.lint()
    new.recompile()
    ctx.invalidate("time")
    ctx.analyses["time"] = analyze_time_locality(new, time_axis=ctx.time_axis)
    return PassResult(new, changed=True, notes=tuple(notes))
