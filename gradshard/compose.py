"""Compose with Inductor: compile the parts of a rewritten graph that gradshard leaves alone.

A rewritten graph alternates plain aten nodes and *region* nodes: ``call_module`` nodes whose
module has a ``stages()`` method (``adjoint_0``, ``tail_0``, ``seco_0``, ``lasp_*``, ...;
the same test :mod:`gradshard.schedule` uses). :func:`compose_graph` cuts the graph, in graph
order, into steps::

    embedding            -> segment_0  (Inductor: forward and backward, through AOTAutograd)
    adjoint_0, getitem   -> adjoint_0  (region: runs its own autograd.Function, eagerly)
    add_1                -> segment_1  (Inductor)
    ...

A *segment* is a maximal run of plain nodes; a region step is one region node with the
``getitem`` nodes that unpack its outputs. A ``call_module`` of a module that is neither a
region nor an fx ``GraphModule`` (a user's leaf module) is an opaque step run as it is.

Each segment becomes its own small ``GraphModule`` (placeholders for the values it reads,
a tuple of the values later steps or the graph's output read) and is compiled with
``torch._inductor.compile_fx.compile_fx`` at its first call, with the real inputs of that
call: compile_fx runs AOTAutograd, so the compiled segment is an autograd.Function whose
backward Inductor compiled too, and gradients flow between compiled segments and regions
as between eager ops. A compiled variant is specific to its inputs' shapes, strides,
dtypes, devices, ``requires_grad`` flags and the grad mode; another combination compiles
another variant (never a silently gradient-free one). :class:`ComposedGraph` runs the steps
and drops every value after its last reader, as fx's generated code does, so composing
keeps the memory profile of the eager graph (inside a segment AOTAutograd's partitioner
decides what is saved for backward).

``gs.compile(..., inductor=True)`` composes every specialisation it runs (a length the adjoint
plan serves by re-specialising gets its own composition); ``gs.backend`` composes Dynamo's
graph by default (``inductor=False`` runs it eagerly). ``fallback_random`` is set, so random
ops draw from the global generator as the eager graph does.

Regions are not compiled as a whole: each runs its own autograd.Function (a Python loop over
shards or chunks). What they run per shard is, with the same compiler: :func:`compose_graph`
hands it to every region module that has ``use_graph_compiler`` (:mod:`gradshard.runtime.compiled`).
``adjoint``/``truncated_adjoint`` regions compile their producer, readout and input-recompute
graphs, ``tail_*`` regions their recomputed segment, each once per window length and input
signature (forward without grad, backward recompute with grad), cached on the region; a graph
the compiler refuses runs eagerly (logged). The scans between them run the kernels
(:mod:`gradshard.kernels`). For ``seco``/``spaco`` the region *is* the whole captured graph,
run chunk by chunk by a demand-driven evaluator (:mod:`gradshard.plans.chunked.evaluate`).
Composed, it runs its runs of time-local nodes (norms, projections, RoPE, MLPs: everything
between two attentions) as compiled groups, one variant per chunk width and grad mode
(:mod:`gradshard.plans.chunked.groups`; the attention itself reads a KV cache as long as the
steps before the chunk and stays a kernel call), and keeps each chunk's attention output for
its backward instead of recomputing it (:class:`~gradshard.plans.chunked.attention.AttentionStash`:
one activation per attention layer). LASP's communicating modules run as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .ir import graph_module, is_view_node
from .errors import GradshardError, node_error, summary
from .runtime.compiled import RegionGraphs, SharedCompiles, signature
from .schedule import Program

__all__ = ["Segment", "ComposedGraph", "SegmentCompiler", "compose_graph", "compile_with_inductor", "returns_views",
           "mark_program", "is_region_node"]

#: ``compiler(segment_gm, example_inputs) -> callable`` taking the segment's inputs unboxed.
SegmentCompiler = Callable[[fx.GraphModule, list], Callable[..., Any]]

log = logging.getLogger("gradshard")


@dataclass(frozen=True)
class Segment:
    """One step of a composed graph, in run order.

    ``kind``: ``"compiled"`` (plain nodes compiled, by Inductor by default), ``"eager"`` (plain nodes with
    nothing to compile: views and tuple unpacking only), ``"region"`` (a gradshard region and
    its getitems) or ``"opaque"`` (a leaf module run as it is). ``inputs``/``outputs`` are
    the names of the graph values the step reads and hands on.
    """

    name: str
    kind: str
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def compiled(self) -> bool:
        return self.kind == "compiled"


def is_region_node(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A region installed by a plan: a ``call_module`` whose module has ``stages()``."""
    return node.op == "call_module" and hasattr(gm.get_submodule(str(node.target)), "stages")


def _is_opaque(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A ``call_module`` gradshard cannot see into (not a region, not an fx graph)."""
    return (node.op == "call_module" and not is_region_node(gm, node)
            and not isinstance(gm.get_submodule(str(node.target)), fx.GraphModule))


def _is_unpack(node: fx.Node, of: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem and node.args[0] is of


def _group(gm: fx.GraphModule) -> list[tuple[str, str, list[fx.Node]]]:
    """``(name, kind, nodes)`` for every step, in graph order (see the module doc)."""
    steps: list[tuple[str, str, list[fx.Node]]] = []
    run: list[fx.Node] = []
    taken: set[fx.Node] = set()

    def close() -> None:
        if run:
            compute = any(n.op in ("call_function", "call_method", "call_module") and n.target is not operator.getitem
                          for n in run)
            n_seg = sum(1 for _, k, _ in steps if k in ("compiled", "eager"))
            steps.append((f"segment_{n_seg}", "compiled" if compute else "eager", list(run)))
            run.clear()

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or node in taken:
            continue
        if is_region_node(gm, node) or _is_opaque(gm, node):
            close()
            unpack = [u for u in node.users if _is_unpack(u, node)]
            taken.update(unpack)
            kind = "region" if is_region_node(gm, node) else "opaque"
            steps.append((str(node.target), kind, [node, *sorted(unpack, key=lambda u: u.args[1])]))
            continue
        run.append(node)
    close()
    return steps


def _step_graph(gm: fx.GraphModule, nodes: Sequence[fx.Node], inputs: Sequence[fx.Node],
                outputs: Sequence[fx.Node]) -> fx.GraphModule:
    """``nodes`` as a GraphModule: placeholders ``inputs``, returning the tuple ``outputs``."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        ph = g.placeholder(n.name)
        ph.meta = dict(n.meta)
        env[n] = ph

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":  # constants: copied into every step that reads them
            env[a] = g.node_copy(a)
        return env[a]

    for n in nodes:
        env[n] = g.node_copy(n, lookup)
    g.output(tuple(env[o] for o in outputs))
    return graph_module(gm, g, "GradshardStep")


def compile_with_inductor(gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    """Inductor through AOTAutograd (forward now, backward at the first backward).

    Random ops fall back to aten, so a seeded call draws what the eager graph draws.
    ``compile_fx`` takes ownership of ``gm`` (it may change it).

    AOTAutograd's on-disk cache is off for graphs that return views (:func:`returns_views`;
    Inductor's FX graph cache still serves their kernels): in torch 2.13 such an entry stores the
    views' replay metadata (outputs aliasing an intermediate: a chunk group's ``transpose`` of a
    projection) as process addresses, and the next process that loads it fails in
    ``gen_alias_from_base`` with garbage sizes (``shape '[94804194802712, 5090430415215529921, 4]'
    is invalid``), as torch's own config notes (``view_replay_for_aliased_outputs``: not compatible
    with AOTAutogradCache). The price is AOTAutograd's trace of those graphs at a warm first call;
    seco's chunk groups leave their trailing views out (``groups._peel_output_views``) to keep it.
    """
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # Static fake inputs under a mode with a shape env, as Dynamo hands them over: Inductor's
    # FX graph cache (and AOTAutograd's) then serve a segment compiled before from disk.
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    uncached = returns_views(gm)
    with torch._functorch.config.patch(enable_autograd_cache=False) if uncached else contextlib.nullcontext():
        return compile_fx(gm, fakes, config_patches={"fallback_random": True})


def returns_views(gm: fx.GraphModule) -> bool:
    """Whether an output of ``gm`` is made by a view op (directly, or an item of a view op's list)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for node in torch.utils._pytree.tree_leaves(out.args):
        if not isinstance(node, fx.Node):
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        if is_view_node(node):
            return True
    return False


compile_with_inductor.display_name = "Inductor"  # type: ignore[attr-defined]


class _CompiledStep:
    """A segment's GraphModule plus its compiled variants (compiled at first use)."""

    def __init__(self, record: Segment, make_gm: Callable[[], fx.GraphModule], first: fx.Node,
                 compiler: SegmentCompiler, compiler_name: str) -> None:
        self.record = record
        self.make_gm = make_gm
        self.first = first
        self.compiler = compiler
        self.compiler_name = compiler_name
        self.variants: dict[tuple, Callable[..., Any]] = {}
        self.compile_seconds = 0.0

    def __call__(self, args: list[Any]) -> Sequence[Any]:
        key = signature(args)
        fn = self.variants.get(key)
        if fn is None:
            fn = self._compile(args)
            self.variants[key] = fn
        return fn(*args)  # compile_fx's result takes the graph's own (unboxed) arguments

    def _compile(self, args: list[Any]) -> Callable[..., Any]:
        t0 = time.perf_counter()
        try:
            fn = self.compiler(self.make_gm(), list(args))  # a fresh GraphModule: compilers may change it
        except Exception as exc:  # noqa: BLE001 - any compiler failure is reported with the segment
            raise node_error(
                self.first, f"{self.compiler_name} could not compile {self.record.name} "
                f"({len(self.record.nodes)} nodes from `{self.record.nodes[0]}` to `{self.record.nodes[-1]}`): "
                f"{summary(exc)}",
                "compile with inductor=False (gs.compile) or gs.backend(..., inductor=False) to run this "
                "segment eagerly", GradshardError) from exc
        self.compile_seconds += time.perf_counter() - t0
        log.info("gradshard: %s compiled %s (%d nodes) in %.1f s", self.compiler_name, self.record.name,
                 len(self.record.nodes), time.perf_counter() - t0)
        return fn


class _EagerStep:
    """A step run as fx code (regions, opaque modules, segments with nothing to compile)."""

    def __init__(self, record: Segment, gm: fx.GraphModule) -> None:
        self.record = record
        self.gm = gm

    def __call__(self, args: list[Any]) -> Sequence[Any]:
        return self.gm(*args)


class ComposedGraph:
    """Runs a rewritten graph step by step: segments compiled by Inductor, regions as they are.

    Call it like the graph (``composed(*flat)``). ``segments`` are the step records;
    ``source`` is the GraphModule it was cut from (a re-specialised graph gets its own).
    """

    def __init__(self, source: fx.GraphModule, segments: Sequence[Segment], runners: Sequence[Any],
                 frees: Sequence[tuple[str, ...]], placeholders: Sequence[str], output: Any,
                 compiler_name: str = "Inductor") -> None:
        self.source = source
        self.compiler_name = compiler_name
        self.segments = tuple(segments)
        self._runners = list(runners)
        self._frees = list(frees)
        self._placeholders = list(placeholders)
        self._output = output

    def __call__(self, *flat: Any) -> Any:
        if len(flat) != len(self._placeholders):
            raise GradshardError(f"composed graph: expected {len(self._placeholders)} inputs, got {len(flat)}")
        env: dict[str, Any] = dict(zip(self._placeholders, flat))
        for seg, run, free in zip(self.segments, self._runners, self._frees):
            outs = run([env[n] for n in seg.inputs])
            env.update(zip(seg.outputs, outs))
            del outs
            for n in free:  # a value after its last reader: drop it, as fx's generated code does
                env.pop(n, None)
        return fx.node.map_aggregate(self._output, lambda a: env[a.name] if isinstance(a, fx.Node) else a)

    # ---------------------------------------------------------------- inspection

    @property
    def compiled_segments(self) -> tuple[Segment, ...]:
        """The segments handed to the compiler (Inductor by default)."""
        return tuple(s for s in self.segments if s.compiled)

    @property
    def compiled_variants(self) -> int:
        """How many segment compilations have run so far (segments x input signatures)."""
        return sum(len(r.variants) for r in self._runners if isinstance(r, _CompiledStep))

    @property
    def compile_seconds(self) -> float:
        return sum(r.compile_seconds for r in self._runners if isinstance(r, _CompiledStep))

    def describe(self) -> str:
        n = len(self.compiled_segments)
        lines = [f"compose: {n} segment(s) compiled by {self.compiler_name} (forward and backward), "
                 f"{self.compiled_variants} variant(s) compiled so far (forward compile {self.compile_seconds:.1f} s; "
                 "each backward compiles at its first backward); regions run their own autograd.Functions, "
                 "their per-shard graphs compiled"]
        by_name = {n.name: n for n in self.source.graph.nodes}
        for s in self.segments:
            what = {"compiled": self.compiler_name, "eager": "eager (nothing to compile)",
                    "region": "region (not compiled as a whole: its own autograd.Function)",
                    "opaque": "opaque module (not compiled)"}[s.kind]
            span = s.nodes[0] if len(s.nodes) == 1 else f"{s.nodes[0]} .. {s.nodes[-1]}"
            lines.append(f"  - {s.name}: {what}; {len(s.nodes)} node(s) [{span}]")
            if s.kind == "region":
                lines.extend(_region_lines(self.source.get_submodule(str(by_name[s.nodes[0]].target))))
        return "\n".join(lines)


def _region_lines(module: Any) -> list[str]:
    """What a region runs compiled (for :meth:`ComposedGraph.describe`)."""
    lines = []
    graphs = getattr(module, "graphs", None)
    if isinstance(graphs, RegionGraphs):
        lines.append(f"      per-shard graphs: {graphs.describe()}")
    if getattr(module, "stash_attention", False):
        lines.append("      attention outputs kept from the forward for the backward (not recomputed)")
    groups = getattr(module, "compiled_groups", None)
    if groups is not None and hasattr(groups, "describe") and getattr(module, "compiler", None) is not None:
        lines.append(f"      per-chunk: {groups.describe()}")
    return lines


def compose_graph(gm: fx.GraphModule, compiler: SegmentCompiler | None = None) -> ComposedGraph:
    """Cut ``gm`` into segments and regions (module doc); segments compile at their first call.

    ``compiler`` defaults to :func:`compile_with_inductor`; any ``(gm, example_inputs) ->
    callable`` that keeps autograd working (e.g. AOTAutograd with another compiler) will do.
    """
    compiler = compiler or compile_with_inductor
    compiler_name = getattr(compiler, "display_name", getattr(compiler, "__name__", type(compiler).__name__))
    groups = _group(gm)
    step_of: dict[fx.Node, int] = {n: i for i, (_, _, nodes) in enumerate(groups) for n in nodes}
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    n_steps = len(groups)
    last_read: dict[str, int] = {}
    records: list[Segment] = []
    runners: list[Any] = []
    region_compiler = SharedCompiles(compiler)  # layers' regions cut alike compile their graphs once
    for i, (name, kind, nodes) in enumerate(groups):
        members = set(nodes)
        inputs: list[fx.Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in members and a.op != "get_attr" and a not in inputs:
                    inputs.append(a)
        for a in inputs:
            last_read[a.name] = i
        outputs = [n for n in nodes if any(u not in members and (u is out_node or step_of.get(u, i) > i)
                                           for u in n.users)]
        rec = Segment(name, kind, tuple(n.name for n in nodes), tuple(a.name for a in inputs),
                      tuple(o.name for o in outputs))
        if kind == "region":
            _hand_compiler_to_region(gm.get_submodule(str(nodes[0].target)), region_compiler)
        records.append(rec)
        make = _maker(gm, nodes, inputs, outputs)
        runners.append(_CompiledStep(rec, make, nodes[0], compiler, compiler_name) if kind == "compiled"
                       else _EagerStep(rec, make()))
    for a in out_node.all_input_nodes:
        last_read[a.name] = n_steps  # read by the output: kept to the end
    frees: list[list[str]] = [[] for _ in groups]
    for name, i in last_read.items():
        if i < n_steps:
            frees[i].append(name)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return ComposedGraph(gm, records, runners, [tuple(f) for f in frees], placeholders, out_node.args[0],
                         compiler_name)


def _hand_compiler_to_region(module: Any, compiler: SegmentCompiler) -> None:
    """A region that runs graphs per shard or chunk compiles them with ``compiler`` too
    (``use_graph_compiler``; :mod:`gradshard.runtime.compiled`); others run as they are."""
    use = getattr(module, "use_graph_compiler", None)
    if callable(use):
        use(compiler)


def _maker(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node],
           outputs: list[fx.Node]) -> Callable[[], fx.GraphModule]:
    return lambda: _step_graph(gm, nodes, inputs, outputs)


def mark_program(program: Program, composed: ComposedGraph) -> Program:
    """``program`` with ``kernel="inductor..."`` on the plain stages whose nodes are compiled
    (the compiler's name in lower case for another compiler)."""
    compiled = {n for s in composed.compiled_segments for n in s.nodes}
    stages = []
    for s in program.stages:
        if s.region is None and s.nodes and set(s.nodes) <= compiled and s.kernel.startswith("torch"):
            s = dataclasses.replace(s, kernel=composed.compiler_name.lower() + s.kernel[len("torch"):])
        stages.append(s)
    dag = program.dag.copy()
    for s in stages:
        if s.name in dag:
            dag.nodes[s.name]["stage"] = s
    return Program(stages=tuple(stages), dag=dag)
