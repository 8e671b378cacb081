"""The pass protocol and the pass manager.

A pass is a named callable ``(gm, ctx) -> PassResult``. *Detect* passes are pure analyses:
they return the same graph with ``changed=False`` and their findings as ``regions``.
*Rewrite* passes return a new graph. The manager runs one explicit ordered list per plan
(see :mod:`gradshard.plans.registry`), lints the graph after every pass, and records a
:class:`~gradshard.ir.PassRecord` (before/after code, created/erased nodes, notes) so
``cm.explain()`` and ``gradshard show`` can print every intermediate graph. Two small graph
helpers every pass room shares live here too: :func:`copy_graph` and :func:`ancestors`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch.fx as fx

from .errors import GradshardError
from .ir import PassRecord, Region

__all__ = ["PassContext", "PassResult", "GraphPass", "graph_pass", "run_passes", "lint_graph", "PassFailed",
           "copy_graph", "GraphSummary", "summarize_graph", "forget_erased_nodes", "generated_sources", "release_generated_sources", "TRACE_LOCK", "ancestors", "descendants"]


class PassFailed(GradshardError):
    """A pass raised or produced an invalid graph."""


@dataclass
class PassContext:
    """What every pass may read: the plan, its options, example inputs and earlier findings.

    ``analyses`` caches analysis results by name (e.g. ``"time"`` holds the
    :class:`~gradshard.analysis.locality.TimeLocality`); a rewrite pass that changes the
    graph must drop the analyses it invalidates with :meth:`invalidate`.
    """

    plan: str
    options: Mapping[str, Any]
    example_inputs: Sequence[Any]
    captured: Any = None
    regions: list[Region] = field(default_factory=list)
    analyses: dict[str, Any] = field(default_factory=dict)
    strict: bool = True  # plan "none" runs detection non-strictly (findings only)
    time_axis: tuple[int, int] | None = None  # user hint: (input index, dim)
    backend: str | None = None  # kernel backend override: "torch" | "triton" | None (auto)
    #: flat placeholder index -> time dim, as first found (kept when analyses are invalidated)
    input_time_dims: dict[int, int] = field(default_factory=dict)
    #: what the plan's ``prepare`` step established before the passes (never invalidated)
    plan_state: dict[str, Any] = field(default_factory=dict)

    def invalidate(self, *names: str) -> None:
        for n in names or list(self.analyses):
            self.analyses.pop(n, None)

    def regions_of(self, kind: str) -> list[Region]:
        return [r for r in self.regions if r.kind == kind]


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly new) graph, whether it changed, and findings."""

    gm: fx.GraphModule
    changed: bool = False
    regions: tuple[Region, ...] = ()
    notes: tuple[str, ...] = ()


class GraphPass(Protocol):
    name: str
    __doc__: str | None

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult: ...


@dataclass(frozen=True)
class _FnPass:
    name: str
    fn: Callable[[fx.GraphModule, PassContext], PassResult]
    doc: str

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        return self.fn(gm, ctx)


def graph_pass(fn: Callable[[fx.GraphModule, PassContext], PassResult]) -> _FnPass:
    """Decorator: turn ``def verb_object(gm, ctx) -> PassResult`` into a named pass."""
    return _FnPass(fn.__name__, fn, (fn.__doc__ or "").strip().split("\n\n")[0])


def copy_graph(gm: fx.GraphModule) -> fx.Graph:
    """A copy of ``gm``'s graph (same node names and meta) for a rewrite pass to change."""
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    return g


@dataclass(frozen=True)
class GraphSummary:
    """What a compiled entry keeps of the graph it was captured as: its code and node count.

    The graph itself is the passes' input (some rewrite it in place, rolling a loop); a copy
    kept only to show it would hold every node of the capture -- 67 unrolled steps of a
    loop-written model -- for the life of the entry."""

    code: str
    num_nodes: int


def summarize_graph(gm: fx.GraphModule) -> GraphSummary:
    """``gm``'s code (the string its ``code`` already holds) and node count."""
    return GraphSummary(gm.code, len(gm.graph.nodes))


def generated_sources() -> set[str]:
    """The keys of the sources fx has generated so far (see :func:`release_generated_sources`)."""
    from torch.fx.graph_module import _loader

    return set(list(_loader.eval_cache))


#: Held while tracing (make_fx is not thread-safe, and its stack-trace recording reads fx's
#: generated sources through ``linecache``) and while :func:`release_generated_sources` runs.
TRACE_LOCK = threading.RLock()


def release_generated_sources(before: set[str], keep: Iterable[fx.GraphModule]) -> None:
    """Release the sources fx generated since ``before``, except those of ``keep`` and their submodules.

    Every ``recompile`` of a GraphModule stores its Python source in a process-wide cache
    (``torch.fx.graph_module._loader``) and a lazy ``linecache`` entry (with a copy of the
    module's globals), and never removes them: a compile that rewrites a graph pass by pass
    would keep every intermediate version's source. Only tracebacks read them, so a graph whose
    source is released still runs; a traceback through it shows no source line (also for a
    graph another thread compiled meanwhile: thread-based ranks compile side by side). The
    key stays with an empty source: fx's loader reads ``key in cache`` then ``cache[key]``,
    which a deletion from another thread could split."""
    import linecache

    from torch.fx.graph_module import _loader

    kept = {type(m).forward.__code__.co_filename for root in keep for m in root.modules()
            if isinstance(m, fx.GraphModule) and hasattr(type(m).forward, "__code__")}
    with TRACE_LOCK:
        # list() copies the keys in one step: other threads (thread-based ranks) recompile meanwhile
        for key in [k for k in list(_loader.eval_cache) if k not in before and k not in kept]:
            _loader.eval_cache[key] = ""
            linecache.cache.pop(key, None)


def forget_erased_nodes(graph: fx.Graph) -> None:
    """Let the nodes erased from ``graph`` be freed.

    fx's name table (``Graph._graph_namespace``) keeps every node it ever named, erased ones
    too, and with them their ``meta`` (fake values, stack traces): a loop rolled in place
    would keep its unrolled steps alive for as long as the graph lives. Their names stay
    reserved (``_used_names``); only the table's references to the node objects go."""
    table = getattr(getattr(graph, "_graph_namespace", None), "_obj_to_name", None)
    if isinstance(table, dict):
        for obj in [o for o in list(table) if isinstance(o, fx.Node) and o._erased]:
            del table[obj]


def ancestors(roots: Iterable[Any], within: Callable[[fx.Node], bool] | None = None) -> set[fx.Node]:
    """The nodes among ``roots`` and every node they read from, transitively.

    ``within``: walk only the nodes for which it holds (a root failing it is left out, and
    the walk does not pass through such a node). Non-node roots are ignored.
    """
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen or (within is not None and not within(n)):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def descendants(roots: Iterable[Any], within: Callable[[fx.Node], bool] | None = None) -> set[fx.Node]:
    """The nodes among ``roots`` and every node that reads them, transitively (``within`` as in
    :func:`ancestors`)."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen or (within is not None and not within(n)):
            continue
        seen.add(n)
        stack.extend(n.users)
    return seen


def lint_graph(gm: fx.GraphModule) -> None:
    """Check the graph is well formed and every tensor node has shape metadata."""
    gm.graph.lint()
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_module", "call_method", "placeholder") and "val" not in node.meta:
            if node.op == "call_module" or node.meta.get("gs_no_val"):
                continue
            raise PassFailed(f"node `{node.name}` has no shape metadata (meta['val']) after a pass")


def run_passes(gm: fx.GraphModule, passes: Sequence[GraphPass], ctx: PassContext,
               progress: Callable[[str], None] | None = None) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Run ``passes`` in order; return the final graph and one record per pass."""
    records: list[PassRecord] = []
    for p in passes:
        if progress:
            progress(p.name)
        before_code = gm.code
        before_nodes = {n.name for n in gm.graph.nodes}
        t0 = time.perf_counter()
        result = p(gm, ctx)
        dt = time.perf_counter() - t0
        new = result.gm
        if result.changed:
            forget_erased_nodes(new.graph)
            new.recompile()
            try:
                lint_graph(new)
            except GradshardError:
                raise
            except Exception as exc:  # fx lint errors
                raise PassFailed(f"pass {p.name} produced an invalid graph: {exc}") from exc
        after_nodes = {n.name for n in new.graph.nodes}
        ctx.regions.extend(result.regions)
        records.append(PassRecord(
            name=p.name,
            doc=getattr(p, "doc", "") or (p.__doc__ or "").strip().split("\n\n")[0],
            changed=result.changed,
            before=before_code,
            after=new.code if result.changed else before_code,
            created=tuple(sorted(after_nodes - before_nodes)),
            erased=tuple(sorted(before_nodes - after_nodes)),
            notes=result.notes,
            regions=result.regions,
            seconds=dt,
        ))
        gm = new
    return gm, records
