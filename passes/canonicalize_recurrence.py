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

Later passes then see one scan node per recurrence, and the time analysis is recomputed on
a graph without the scan's internals (whose many equal-sized pieces can otherwise make
the dims analysis conflate the time axis with other axes of the same size). The numbers
computed are those of the recurrence (up to rounding, without the log-space overflow).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from gradshard.analysis.locality import analyze_time_locality
from gradshard.pipeline import PassContext, PassResult, graph_pass

from . import recurrence_ops  # noqa: F401
from .detect_recurrence import ScanSite, find_scan_sites
from .recurrence_graph import copy_graph_module, fake_run, live_nodes
from .recurrence_normalize import unmerge_matmuls

aten = torch.ops.aten

__all__ = ["canonicalize_recurrences"]


def _emit(graph: fx.Graph, target, args, trace=None) -> fx.Node:
    n = graph.call_function(target, args)
    n.meta["val"] = fake_run(target, args)
    if trace:
        n.meta["stack_trace"] = trace
    return n


def _to_time1(graph: fx.Graph, x: fx.Node, td: int, rank: int, trace) -> fx.Node:
    if x.meta["val"].dim() < rank:
        shape = [1] * (rank - x.meta["val"].dim()) + list(x.meta["val"].shape)
        x = _emit(graph, aten.reshape.default, (x, shape), trace)
    if td == 1:
        return x
    perm = list(range(rank))
    perm.insert(1, perm.pop(td))
    return _emit(graph, aten.permute.default, (x, perm), trace)


def _from_time1(graph: fx.Graph, x: fx.Node, td: int, rank: int, trace) -> fx.Node:
    if td == 1:
        return x
    perm = list(range(rank))
    perm.insert(1, perm.pop(td))
    inv = [perm.index(i) for i in range(rank)]
    return _emit(graph, aten.permute.default, (x, inv), trace)


def _rewrite(gm: fx.GraphModule, site: ScanSite) -> str:
    nodes = {n.name: n for n in gm.graph.nodes}
    h = nodes[site.h]
    u = nodes[site.u]
    a = nodes[site.a] if site.a else None
    rank = u.meta["val"].dim()
    td = site.time_dim
    if rank < 2:
        return f"left {site.written_as} at {h.name} as is (1-d)"
    trace = h.meta.get("stack_trace")
    graph = gm.graph
    with graph.inserting_before(h):
        u1 = _to_time1(graph, u, td, rank, trace)
        if a is None:
            # u-shaped (not broadcast) so the time analysis sees the scan's time axis on `a`
            a1 = _emit(graph, aten.ones_like.default, (u1,), trace)
        else:
            a1 = _to_time1(graph, a, td, rank, trace)
        if site.kind == "dense":
            scan = _emit(graph, torch.ops.gradshard.dense_linear_scan.default, (a1, u1, None), trace)
        else:
            scan = _emit(graph, torch.ops.gradshard.linear_scan.default, (a1, u1, None, False, None), trace)
        scan.meta["gs_written_as"] = site.written_as
        out = _from_time1(graph, scan, td, rank, trace)
    if out.meta["val"].dtype != h.meta["val"].dtype:
        with graph.inserting_before(h):
            out = _emit(graph, aten._to_copy.default, (out,), trace)
    h.replace_all_uses_with(out)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for name in sorted((c for c in site.covered if c in nodes), key=lambda x: -order[nodes[x]]):
        n = nodes[name]
        if not n.users:
            graph.erase_node(n)
    return f"{site.written_as} at {site.h} -> {scan.name}"


@graph_pass
def canonicalize_recurrences(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite each vectorised scan as one gradshard scan-op node (see module doc)."""
    tl = ctx.analyses.get("time")
    if tl is None:
        return PassResult(gm, notes=("no time axis",))
    sites = [s for s in find_scan_sites(gm, tl) if len(s.covered) > 1 or s.written_as == "cumsum"]
    new = copy_graph_module(gm)
    new.graph.eliminate_dead_code()
    merged = unmerge_matmuls(new)
    if not sites and not merged:
        return PassResult(gm, notes=("scans already canonical",))
    live = live_nodes(new)
    notes = [f"restored {merged} matmul(s) decomposed over merged batch*time rows"] if merged else []
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
