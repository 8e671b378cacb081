"""Graphs a region runs many times (per shard, per chunk), compiled once per input signature.

A region module (``adjoint_*``, ``tail_*``, ...) runs small fx graphs -- its producer and
readout, a recomputed segment -- once per shard in the forward and again in the backward.
Run eagerly, every op is a Python-level dispatch; on a GPU every op a kernel launch. When the
rest of the program is compiled by Inductor (``gs.compile(..., inductor=True)``,
``gs.backend``), :mod:`gradshard.compose` hands the same compiler to the regions
(``use_graph_compiler``), and they run those graphs through :class:`RegionGraphs`:

* one :class:`GraphVariants` per graph (e.g. ``("producer", 512)``: the producer
  re-specialised to a 512-step window); a region sees two or three window lengths (full
  shards, the ragged last one, the first shard without a left halo);
* a variant per input *signature* (:func:`signature`: per tensor its shape, strides, dtype,
  device and ``requires_grad``; the grad mode), compiled at its first call with that call's
  inputs and kept: a forward shard (no grad) and a backward recompute (grad) are two
  variants, each compiled once. The compiler (by default ``compile_fx``: AOTAutograd, then
  Inductor) returns a differentiable callable, so ``torch.autograd.grad`` through a compiled
  backward recompute works as through the eager graph;
* the compiler a program hands its regions is a :class:`SharedCompiles`: graphs of the same
  structure (every layer's, cut alike) with the same input signature compile once per program;
* a compile failure is logged once and that variant runs the eager graph: the compiled
  path is an optimisation, never a different gradient;
* at most :data:`MAX_GRAPHS` graphs per region are compiled: a model called at ever new
  lengths (a new ragged last shard each time) runs the graphs past that eagerly instead of
  compiling at every step (logged once).

With no compiler set the region runs its graphs eagerly, as before.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from typing import Any, Callable, Collection, Hashable, Iterator, Optional, Sequence

import torch
import torch.fx as fx

from gradshard.ir import graph_module
from gradshard.errors import summary
from gradshard.pipeline import copy_graph
from gradshard.autocast import AutocastState

__all__ = ["GraphCompiler", "signature", "graph_structure", "SharedCompiles", "GraphVariants", "RegionGraphs",
           "CompiledCalls", "trace_and_compile", "fresh_copy", "LengthCache", "forgetting_new_lengths", "MAX_GRAPHS"]

#: ``compiler(gm, example_inputs) -> callable`` taking the graph's inputs unboxed (the
#: ``SegmentCompiler`` protocol of :mod:`gradshard.compose`).
GraphCompiler = Callable[[fx.GraphModule, list], Callable[..., Any]]

log = logging.getLogger("gradshard")

#: graphs (graph x window length) a region compiles at most; later ones run eagerly
MAX_GRAPHS = 24


def signature(args: Sequence[Any]) -> tuple:
    """What a compiled variant is specific to: per input its layout and grad flag; the grad mode and
    the autocast state (a trace bakes its casts in)."""
    sig: list[Any] = [torch.is_grad_enabled(), AutocastState.current()]
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad))
        else:
            sig.append(("value", a))
    return tuple(sig)


def graph_structure(gm: fx.GraphModule) -> tuple:
    """What ``gm`` computes, without its node names: per node its op, target and arguments (other
    nodes by position). Two layers' graphs cut alike have the same structure; a constant
    (``get_attr``) or submodule counts by identity, so layers with their own constants differ."""
    index: dict[fx.Node, int] = {}
    items: list[tuple] = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        if n.op in ("get_attr", "call_module"):
            target: Any = (n.op, _Same(operator.attrgetter(str(n.target))(gm)))
        elif n.op == "placeholder":
            target = None
        else:
            target = n.target
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("%node", index[a]))
        items.append((n.op, target, repr(args)))
    return tuple(items)


class _Same:
    """An object compared by identity, kept alive by the key holding it (so its id is never reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


class SharedCompiles:
    """``compiler``, remembering what it compiled by graph structure and input signature: the
    regions of one program (every layer's producer, readout or shard graph, cut alike) compile
    each distinct graph once, not once per layer. The compiled callables take every tensor --
    parameters included -- as an input, so one serves every layer."""

    def __init__(self, compiler: GraphCompiler) -> None:
        self.compiler = compiler
        self.display_name = getattr(compiler, "display_name", getattr(compiler, "__name__", type(compiler).__name__))
        self._done: dict[tuple, Callable[..., Any]] = {}
        self.hits = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        key = (graph_structure(gm), signature(example_inputs))
        fn = self._done.get(key)
        if fn is None:
            fn = self._done[key] = self.compiler(gm, example_inputs)
        else:
            self.hits += 1
        return fn


def fresh_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with its own graph (compilers may change the graph they are given)."""
    return graph_module(gm, copy_graph(gm), type(gm).__name__)


class GraphVariants:
    """One graph, compiled per input signature at first use (eager fallback if that fails)."""

    def __init__(self, gm: fx.GraphModule, compiler: GraphCompiler, name: str) -> None:
        self.gm = gm
        self.compiler = compiler
        self.name = name
        self.variants: dict[tuple, Callable[..., Any]] = {}
        self.compile_seconds = 0.0
        self.failures = 0

    def __call__(self, *args: Any) -> Any:
        key = signature(args)
        fn = self.variants.get(key)
        if fn is None:
            fn = self._compile(list(args))
            self.variants[key] = fn
        return fn(*args)

    def _compile(self, args: list[Any]) -> Callable[..., Any]:
        t0 = time.perf_counter()
        try:
            fn = self.compiler(fresh_copy(self.gm), args)
        except Exception as exc:  # noqa: BLE001 - the eager graph computes the same values
            self.failures += 1
            log.warning("gradshard: could not compile %s (%s); running it eagerly", self.name, summary(exc))
            return self.gm
        self.compile_seconds += time.perf_counter() - t0
        log.info("gradshard: compiled %s in %.1f s", self.name, time.perf_counter() - t0)
        return fn


class RegionGraphs:
    """A region's compiled graphs by key; :meth:`get` returns the graph itself without a compiler."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.compiler: Optional[GraphCompiler] = None
        self._graphs: dict[Hashable, GraphVariants] = {}
        self.capped = False  # MAX_GRAPHS reached: later graphs run eagerly
        #: whole functions of a shard (several graphs and the kernels between them) traced and
        #: compiled as one; None without a compiler
        self.calls: Optional[CompiledCalls] = None

    def set_compiler(self, compiler: Optional[GraphCompiler]) -> None:
        """Use ``compiler`` from now on (``None``: run eagerly); a new compiler starts a new cache."""
        if compiler is not self.compiler:
            self.compiler = compiler
            self._graphs.clear()
            self.capped = False
            self.calls = None if compiler is None else CompiledCalls(compiler, self.owner)

    def get(self, key: Hashable, gm: Callable[[], fx.GraphModule]) -> Callable[..., Any]:
        """The callable running graph ``key`` (``gm()`` builds it; called once per key)."""
        if self.compiler is None:
            return gm()
        g = self._graphs.get(key)
        if g is None:
            if len(self._graphs) >= MAX_GRAPHS:
                if not self.capped:
                    log.warning("gradshard: %s compiled %d graphs (window lengths); %s and later ones run eagerly",
                                self.owner, MAX_GRAPHS, _key_name(key))
                self.capped = True
                return gm()
            g = GraphVariants(gm(), self.compiler, f"{self.owner}:{_key_name(key)}")
            self._graphs[key] = g
        return g

    @property
    def compiled_variants(self) -> int:
        """Compiled variants of the graphs and of the whole-shard functions."""
        return sum(len(g.variants) for g in self._graphs.values()) + (len(self.calls.variants) if self.calls else 0)

    @property
    def compile_seconds(self) -> float:
        whole = self.calls.compile_seconds if self.calls else 0.0
        return sum(g.compile_seconds for g in self._graphs.values()) + whole

    @property
    def failures(self) -> int:
        """Graph variants and whole-shard functions left eager because their compile failed."""
        return sum(g.failures for g in self._graphs.values()) + (len(self.calls.failed) if self.calls else 0)

    def describe(self) -> str:
        """One line for ``explain()``."""
        if self.compiler is None:
            return f"{self.owner}: graphs run eagerly"
        name = getattr(self.compiler, "display_name", getattr(self.compiler, "__name__", "compiler"))
        whole = f" and {len(self.calls.variants)} whole-shard function(s)" if self.calls and self.calls.variants else ""
        text = (f"{self.owner}: {len(self._graphs)} graph(s){whole}, {self.compiled_variants} variant(s) compiled by "
                f"{name} ({self.compile_seconds:.1f} s)")
        text += f", {self.failures} left eager (compile failed)" if self.failures else ""
        return text + (f"; more than {MAX_GRAPHS} graphs: the rest run eagerly" if self.capped else "")

    # compiled code is process-local: copies and pickles start with an empty cache
    def __deepcopy__(self, memo: dict) -> "RegionGraphs":
        new = RegionGraphs(self.owner)
        new.set_compiler(self.compiler)
        return new

    def __getstate__(self) -> dict:
        return {"owner": self.owner, "compiler": None, "_graphs": {}, "capped": False, "calls": None}


def trace_and_compile(fn: Callable[..., Any], inputs: Sequence[torch.Tensor],
                      compiler: GraphCompiler) -> Callable[..., Any]:
    """``fn`` traced to aten ops by ``make_fx`` on detached ``inputs`` (no grad), then compiled by
    ``compiler`` for them: a differentiable callable taking the inputs unboxed."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        gm = make_fx(fn)(*(x.detach() for x in inputs))
    return compiler(gm, list(inputs))


class CompiledCalls:
    """Functions of tensors a rule runs (SSD's block form, ...) traced and compiled at first use.

    ``calls(fn, *args)`` runs ``fn(*args)``: its tensor arguments are the compiled function's
    inputs, everything else (None, ints, flags, strings) is fixed in the trace. A variant per
    ``(fn, fixed arguments, signature)``, traced by ``make_fx`` on detached inputs and compiled
    with ``compiler`` (differentiable: a backward recompute differentiates it as it would ``fn``).
    ``fn`` must return tensors or a tuple of them and depend on its arguments alone. A failed
    trace or compile is logged once and that function runs eagerly from then on; past
    :data:`MAX_GRAPHS` variants (ever new window lengths) new ones run eagerly too. Eagerly
    means ``fallback(*args)`` where given (a caller's other compiled path), else ``fn(*args)``.
    Held by the region's :class:`~gradshard.plans.chunked.groups.GroupCache` or
    :class:`RegionGraphs`, whose copies and pickles start without it (compiled code is process-local).
    """

    def __init__(self, compiler: GraphCompiler, owner: str) -> None:
        self.compiler = compiler
        self.owner = owner
        self.variants: dict[tuple, Callable[..., Any]] = {}
        self.failed: set[Callable[..., Any]] = set()
        self.compile_seconds = 0.0
        self.capped = False  # MAX_GRAPHS reached: later variants run eagerly (or by their fallback)

    def __call__(self, fn: Callable[..., Any], *args: Any, fallback: Optional[Callable[..., Any]] = None) -> Any:
        eager = fallback or fn
        if fn in self.failed:
            return eager(*args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        fixed = tuple(None if isinstance(a, torch.Tensor) else ("value", a) for a in args)
        key = (fn, fixed, *signature(tensors))
        compiled = self.variants.get(key)
        if compiled is None:
            if len(self.variants) >= MAX_GRAPHS:
                if not self.capped:
                    self.capped = True
                    log.warning("gradshard: %s compiled %d function variants (window lengths); new ones run %s",
                                self.owner, MAX_GRAPHS, "graph by graph" if fallback else "eagerly")
                return eager(*args)
            compiled = self._compile(fn, args, tensors)
            if compiled is None:
                return eager(*args)
            self.variants[key] = compiled
        out = compiled(*tensors)
        return tuple(out) if isinstance(out, (list, tuple)) else out

    def _compile(self, fn: Callable[..., Any], args: Sequence[Any], tensors: list) -> Optional[Callable[..., Any]]:
        def with_fixed(*ts: torch.Tensor) -> Any:
            it = iter(ts)
            return fn(*(next(it) if isinstance(a, torch.Tensor) else a for a in args))

        name = getattr(fn, "__qualname__", repr(fn))
        t0 = time.perf_counter()
        try:
            compiled = trace_and_compile(with_fixed, tensors, self.compiler)
        except Exception as exc:  # noqa: BLE001 - the eager function computes the same values
            self.failed.add(fn)
            log.warning("gradshard: could not compile %s's %s (%s); running it eagerly", self.owner, name,
                        summary(exc))
            return None
        self.compile_seconds += time.perf_counter() - t0
        log.info("gradshard: compiled %s's %s in %.1f s", self.owner, name, time.perf_counter() - t0)
        return compiled


class LengthCache:
    """A region module's graphs re-specialised per length, in ``self._cache`` (set by the module's
    ``__init__``): what :func:`forgetting_new_lengths` reads and trims."""

    _cache: dict

    def length_keys(self) -> set:
        """The keys of the graphs re-specialised so far."""
        return set(self._cache)

    def forget_lengths(self, keep: Collection = ()) -> None:
        """Drop the graphs re-specialised so far but those in ``keep`` (the compile's check lengths;
        each holds a copy of the graph): later calls re-specialise to the lengths they use."""
        for key in [k for k in self._cache if k not in keep]:
            del self._cache[key]


@contextlib.contextmanager
def forgetting_new_lengths(gm: torch.nn.Module) -> Iterator[None]:
    """The graphs ``gm``'s regions (:class:`LengthCache` modules) re-specialise inside the block are
    dropped when it ends: a check run at a probe length is not a length calls use, and each such
    graph is a copy the module would keep for good."""
    mods = [m for m in gm.modules() if isinstance(m, LengthCache)]
    before = [m.length_keys() for m in mods]
    try:
        yield
    finally:
        for m, keys in zip(mods, before):
            m.forget_lengths(keep=keys)


def _key_name(key: Hashable) -> str:
    return "_".join(str(k) for k in key) if isinstance(key, tuple) else str(key)
