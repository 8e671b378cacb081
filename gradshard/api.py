"""The public entry points: ``gs.compile``, ``CompiledModule``, ``gs.backend``.

``compile`` captures lazily, at the first call, like ``torch.compile``: the first inputs
are the examples. Each distinct input signature (shapes, dtypes, devices, non-tensor
arguments) gets its own capture and program; nothing is silently reused across shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from .capture import FRONTENDS, Captured, capture, capture_graph_module, guard_key, state_key
from .errors import GradshardError, first_line
from .fake import private_dispatch_cache
from .ir import PassRecord, Region
from .pipeline import (GraphSummary, PassContext, generated_sources, release_generated_sources, run_passes,
                       summarize_graph)
from .plans import get_plan, plans
from .plans.length_generic import STATE_KEY as LENGTH_GENERIC
from .compose import ComposedGraph, SegmentCompiler, compose_graph, mark_program
from .schedule import Program, build_program

__all__ = ["compile", "CompiledModule", "CompiledGraph", "backend", "plans", "compile_graph"]

log = logging.getLogger("gradshard")

#: Plans whose gradient equals plain autograd when the sequence has at most one step.
_EXACT_AT_ONE_STEP = ("adjoint", "truncated_adjoint", "seco", "spaco")

#: Specialisations a compiled module keeps (least recently used dropped first).
DEFAULT_CACHE_SIZE = 8


@dataclass
class CompiledGraph:
    """One specialisation: what was captured (code and size), the rewritten graph, its program and history."""

    plan: str
    options: Any
    original: GraphSummary
    gm: fx.GraphModule
    program: Program
    regions: tuple[Region, ...]
    records: tuple[PassRecord, ...]
    ctx: PassContext
    captured: Captured | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def __call__(self, *flat: torch.Tensor) -> Any:
        composed = self.extras.get("inductor")
        if composed is not None and composed.source is self.gm:
            return composed(*flat)
        return self.gm(*flat)


def _with_inductor(entry: CompiledGraph, compiler: SegmentCompiler | None = None) -> CompiledGraph:
    """Hand ``entry``'s plain segments to Inductor (or ``compiler``; :mod:`gradshard.compose`).

    Idempotent. The composition is tied to ``entry.gm``: a re-specialised entry (a new graph)
    is composed anew.
    """
    composed = entry.extras.get("inductor")
    if not isinstance(composed, ComposedGraph) or composed.source is not entry.gm:
        composed = compose_graph(entry.gm, compiler)
        entry.extras["inductor"] = composed
        entry.program = mark_program(entry.program, composed)
    return entry


#: ``serve(compiled_module, args, kwargs) -> CompiledGraph | None``: see ``register_specializer``.
Specializer = Callable[["CompiledModule", tuple, dict], "CompiledGraph | None"]


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], plan: str, options: dict[str, Any],
                  *, captured: Captured | None = None, time_axis: tuple[int, int] | None = None,
                  backend: str | None = None, progress: Callable[[str], None] | None = None,
                  stop_after: str | None = None) -> CompiledGraph:
    """Run ``plan``'s pipeline on an aten graph and schedule the result.

    ``stop_after``: run the passes up to and including this one only, and leave the result
    unscheduled (a probe a specialiser serves other lengths from; ``PlanSpec.probe_until``)."""
    spec = get_plan(plan)
    opts = spec.make_options(**options)
    ctx = PassContext(plan=plan, options=opts, example_inputs=example_inputs, captured=captured,
                      strict=spec.needs_time_axis, time_axis=time_axis, backend=backend)
    original = summarize_graph(gm)  # before the passes: some rewrite the graph in place
    prepared = _prepare(spec, gm, ctx)
    passes = spec.pipeline()
    if stop_after is not None:
        passes = passes[: [p.name for p in passes].index(stop_after) + 1]
    out_gm, records = run_passes(gm, passes, ctx, progress)
    records = [*prepared, *records]
    if stop_after is not None:  # a probe is never run: it holds the graph kept to serve from, not a copy of it
        kept = getattr(ctx.plan_state.get(LENGTH_GENERIC), "graph", None)
        out_gm = kept if isinstance(kept, fx.GraphModule) else out_gm
    program = build_program(out_gm) if stop_after is None else Program((), nx.DiGraph())
    return CompiledGraph(plan, opts, original, out_gm, program, tuple(ctx.regions), tuple(records), ctx, captured)


@contextlib.contextmanager
def _leftovers_dropped(kept: Callable[[], Sequence[fx.GraphModule]]) -> Iterator[None]:
    """Around a compile: drop what torch and fx would keep of it for the life of the process --
    its fake-tensor dispatch-cache entries and the generated sources of every graph but those
    ``kept()`` returns at exit (the graphs the compiled module runs or serves from)."""
    sources = generated_sources()
    with private_dispatch_cache():
        yield
    release_generated_sources(sources, kept())


def _prepare(spec: Any, gm: fx.GraphModule, ctx: PassContext) -> list[PassRecord]:
    """Run the plan's ``prepare`` step (not a pass: it may talk to other ranks); record it."""
    if spec.prepare is None:
        return []
    t0 = time.perf_counter()
    notes = spec.prepare(gm, ctx)
    doc = (spec.prepare.__doc__ or "").strip().split("\n\n")[0]
    return [PassRecord(name=spec.prepare.__name__, doc=doc, changed=False, before=gm.code, after=gm.code,
                       created=(), erased=(), notes=tuple(notes), regions=(), seconds=time.perf_counter() - t0)]


class CompiledModule(nn.Module):
    """What :func:`compile` returns: call it like the original; gradients land in its params.

    Attributes (valid after the first call): ``regions``, ``program``, ``passes`` (the
    pass records), ``graph`` (the rewritten ``fx.GraphModule``); ``explain()`` prints a
    summary; ``trace(i)`` the graph after pass ``i``.
    """

    def __init__(self, target: nn.Module | Callable[..., Any], plan: str = "none", *,
                 frontend: str = "python", time_axis: tuple[int, int] | None = None,
                 backend: str | None = None, cache_size: int = DEFAULT_CACHE_SIZE, inductor: bool = False,
                 **options: Any) -> None:
        super().__init__()
        spec = get_plan(plan)
        spec.make_options(**options)  # fail fast on bad options
        _check_compile_args(frontend, time_axis, backend, cache_size)
        if not isinstance(inductor, bool):
            raise GradshardError(f"inductor must be True or False, got {inductor!r}")
        self.inductor = inductor
        #: With ``inductor=True``: the segment compiler (None: Inductor; tests use cheaper ones).
        self.segment_compiler: SegmentCompiler | None = None
        self.cache_size = cache_size
        self.plan = plan
        self.options = options
        self.frontend = frontend
        self.time_axis = time_axis
        self.backend = backend
        if isinstance(target, nn.Module):
            self.model = target
        else:
            self._fn = target
        self._cache: OrderedDict[tuple, CompiledGraph] = OrderedDict()
        #: probes compiled only through the plan's length-generic passes (``PlanSpec.probe_until``):
        #: kept for its specialiser to serve other lengths from, never run
        self._probes: OrderedDict[tuple, CompiledGraph] = OrderedDict()
        #: probe keys the plan refused: not compiled again (the call is captured at its length)
        self._refused_probes: set[tuple] = set()
        self.serve_notes: list[str] = []  # why a kept graph did not serve the last compile miss (explain())
        # (module state, (T, B), graph) of the last capture with symbolic sizes (plans/length_generic.py):
        # the graph then captured at that length takes it when the next length comes, not a trace of its own
        self.symbolic_trace: tuple[Any, Any, fx.GraphModule] | None = None
        self._last: CompiledGraph | None = None
        self._specializers: list[Specializer] = []
        self._plan_serve = spec.serve
        if spec.serve is not None:
            self._specializers.append(spec.serve)

    # ---------------------------------------------------------------- calling

    @property
    def target(self) -> nn.Module | Callable[..., Any]:
        return self.model if "model" in self._modules else self._fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        entry = self.compiled_for(*args, **kwargs)
        if "run_eagerly" in entry.extras:  # plan none on an unrolled loop at a new length
            return self.target(*args, **kwargs)
        cap = entry.captured
        assert cap is not None
        flat = [*cap.call_state(), *cap.flat_inputs(args, kwargs)]
        return cap.finish(list(entry(*flat)))

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        """The guards of a specialisation: the inputs' signature and the modules' state."""
        return (guard_key(args, kwargs), state_key(self.target, args, kwargs))

    def compiled_for(self, *args: Any, **kwargs: Any) -> CompiledGraph:
        """The specialisation for this input signature: cached, served by a registered
        specialiser (e.g. the adjoint plan's new-length server), or captured and compiled."""
        return self.compile_first(args, kwargs)

    def compile_first(self, args: tuple, kwargs: dict | None = None, *,
                      real_values: Mapping[int, torch.Tensor] | None = None) -> CompiledGraph:
        """What a call with ``args``/``kwargs`` compiles (cached entry, served entry, a compile at
        the plan's probe length then served, or a capture at these inputs), with ``real_values``
        as in :meth:`specialize` (the cost model prices a first step on fake tensors with it)."""
        kwargs = kwargs or {}
        key = self._key(args, kwargs)
        entry = self._cache.get(key)
        if entry is not None:
            self._cache.move_to_end(key)
        else:
            with _leftovers_dropped(self._kept_graph_modules):
                entry = self._compile_miss(key, args, kwargs, real_values)
        if self.inductor and "run_eagerly" not in entry.extras:
            entry = _with_inductor(entry, self.segment_compiler)
        self._last = entry
        return entry

    def _kept_graph_modules(self) -> list[fx.GraphModule]:
        """The graphs the cached entries and probes run or serve from (their sources stay)."""
        out = []
        for e in [*self._cache.values(), *self._probes.values()]:
            out.append(e.gm)
            if e.captured is not None:
                out.append(e.captured.gm)
            if e.ctx is not None:
                out += [getattr(v, "graph", None) for v in e.ctx.plan_state.values()]
        return [g for g in out if isinstance(g, fx.GraphModule)]

    def _compile_miss(self, key: tuple, args: tuple, kwargs: dict,
                      real_values: Mapping[int, torch.Tensor] | None) -> CompiledGraph:
        """The entry for a call no cached entry matches: served, compiled at the probe and
        served, or captured at the call's inputs."""
        self.serve_notes = []  # why a kept graph did not serve (appended by the plans' specialisers)
        entry = self._serve(key, args, kwargs)
        why = _guard_change(next(reversed(self._cache)), key) if entry is None and self._cache else None
        p_key = None
        if entry is None:  # real_values only where given: tests stand in a two-argument _compile_probe
            p_key = (self._compile_probe(args, kwargs, real_values) if real_values
                     else self._compile_probe(args, kwargs))
        if p_key:  # a key (a non-empty tuple); None (or a stand-in's False): nothing compiled
            entry = self._serve(key, args, kwargs)
            if entry is not None and why is not None:
                entry.extras["recaptured_because"] = f"{why}: captured again at the probe length, served here"
        unserved = bool(p_key) and entry is None
        if unserved:
            # The probe cannot serve the call it was compiled for (its graph does not
            # re-specialise to this length, e.g. a pad to a chunk multiple that differs):
            # kept, it would hold its graphs for nothing; it is not compiled again either.
            self._probes.pop(p_key, None)
            self._cache.pop(p_key, None)
            self._refused_probes.add(p_key)
        if entry is None:
            entry = self.specialize(args, kwargs, real_values=real_values)
            why_not = "; ".join(dict.fromkeys(self.serve_notes))
            if unserved:
                entry.extras["probe_did_not_serve"] = (
                    f"the program compiled at the {get_plan(self.plan).probe_length}-step probe does not serve "
                    f"this call's length ({why_not or 'no specialiser took it'}): captured at the call's length "
                    "instead, on fake tensors")
            elif why_not and "recaptured_because" in entry.extras:
                entry.extras["recaptured_because"] += f"; no graph kept for other lengths served it ({why_not})"
        return entry

    def _serve(self, key: tuple, args: tuple, kwargs: dict) -> CompiledGraph | None:
        """An entry for these inputs from a registered specialiser (cached), or None."""
        for serve in self._specializers:
            entry = serve(self, args, kwargs)
            if entry is not None:
                # a served entry carries a new graph: schedule it, so `program` and
                # `explain()` describe what runs, not the program it was derived from
                # (its own extras: what it was served from is no recapture of this call)
                extras = {k: v for k, v in entry.extras.items() if k != "recaptured_because"}
                entry = dataclasses.replace(entry, program=build_program(entry.gm), extras=extras)
                self._attach(entry)
                self._remember(key, entry, captured=False)
                return entry
        return None

    def _compile_probe(self, args: tuple, kwargs: dict,
                       real_values: Mapping[int, torch.Tensor] | None = None) -> tuple | None:
        """On a cache miss no specialiser served, for a plan with a ``probe_length`` (a program its
        specialiser serves at other lengths), when every input of rank >= 2 has one length along
        dim 1 and it is more than twice the probe: compile at the inputs cut to the probe length.
        The call is then served from that program, so capture and passes cost the same at every
        T and a loop-written model unrolls the probe's steps, not T; a new batch size or a new
        module state compiles a new probe the same way. A plan with ``probe_until`` (the chunked
        plans) compiles the probe only through its length-generic passes and keeps it for its
        specialiser, uncached. Returns the probe's cache key; None when nothing was compiled: no
        probe applies, this probe was compiled before (and could not serve the call), or the plan
        refuses it (the full-length capture then reports the refusal)."""
        probe = get_plan(self.plan).probe_length if self.plan in plans() else None  # "auto" picks a plan later
        if probe is None or self.time_axis is not None:
            return None
        leaves, spec = pytree.tree_flatten((args, kwargs))
        lengths = {x.shape[1] for x in leaves if isinstance(x, torch.Tensor) and x.dim() >= 2}
        if len(lengths) != 1 or lengths.pop() <= 2 * probe:
            return None
        cut = [x.narrow(1, 0, probe) if isinstance(x, torch.Tensor) and x.dim() >= 2 else x for x in leaves]
        p_args, p_kwargs = pytree.tree_unflatten(cut, spec)
        p_key = self._key(p_args, p_kwargs)
        if p_key in self._cache or p_key in self._probes or p_key in self._refused_probes:
            return None
        p_real = None
        if real_values:
            p_real = dict(real_values)
            for x, c in zip(leaves, cut):
                if c is not x and id(x) in real_values:
                    p_real[id(c)] = real_values[id(x)].narrow(1, 0, probe)
        until = get_plan(self.plan).probe_until
        try:
            if until is None:
                entry = self.specialize(p_args, p_kwargs, real_values=p_real)
            else:
                with torch.random.fork_rng():
                    entry = self.compile_at(p_args, p_kwargs, real_values=p_real, plain_when_short=False,
                                            stop_after=until)
                self._probes[p_key] = entry
                while len(self._probes) > self.cache_size:
                    self._probes.popitem(last=False)
            entry.extras["probe"] = True  # compiled to serve another length (specialisers read it)
        except GradshardError as exc:
            log.info("gradshard: the probe compile at T=%d was refused (%s); capturing at full length",
                     probe, first_line(exc))
            self._refused_probes.add(p_key)
            return None
        return p_key

    def _attach(self, entry: CompiledGraph) -> None:
        """Let a rewritten graph attach what it adds to this module (``gm.gs_attach``:
        partial_update's sliced parameters), whether captured or served."""
        hook = getattr(entry.gm, "gs_attach", None)
        if callable(hook):
            hook(self)

    def _remember(self, key: tuple, entry: CompiledGraph, *, captured: bool = True) -> None:
        """Cache ``entry`` under ``key``; the least recently used entry goes beyond ``cache_size``.
        A ``captured`` entry records which guard made it (``explain()``)."""
        if captured and self._cache and key not in self._cache:
            entry.extras.setdefault("recaptured_because", _guard_change(next(reversed(self._cache)), key))
        self._cache[key] = entry
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def specialize(self, args: tuple, kwargs: dict | None = None, *,
                   real_values: Mapping[int, torch.Tensor] | None = None) -> CompiledGraph:
        """Capture at ``args``/``kwargs``, run the plan's passes and cache the result.

        ``real_values`` maps ``id(example tensor)`` to the tensor whose *values* the passes
        should read instead (the cost model traces with fake tensors but lets analyses read
        real parameter values, e.g. whether a decay mask is causal).
        """
        kwargs = kwargs or {}
        key = self._key(args, kwargs)
        if self._cache:
            log.info("gradshard: %s: capturing again (%d cached)",
                     _guard_change(next(reversed(self._cache)), key), len(self._cache))
        # Compiling runs parts of the model (tracing, checks on the example inputs); it must
        # not consume the user's random stream, or a seeded first call would differ from eager.
        with torch.random.fork_rng():
            entry = self.compile_at(args, kwargs, real_values=real_values)
        self._attach(entry)
        self._remember(key, entry)
        self._last = entry
        return entry

    def compile_at(self, args: tuple, kwargs: dict, *, real_values: Mapping[int, torch.Tensor] | None = None,
                   plain_when_short: bool = True, stop_after: str | None = None) -> CompiledGraph:
        """Capture at ``args``/``kwargs`` and run the plan's passes; nothing is cached.

        ``plain_when_short``: a time axis of 0 or 1 steps compiles plain autograd instead
        (equal to the plan there); False always compiles the plan (a specialiser's probe).
        ``stop_after``: see :func:`compile_graph`."""
        cap = capture(self.target, args, kwargs, frontend=self.frontend)
        example = cap.example_inputs
        if real_values:
            example = [real_values.get(id(t), t) for t in example]
        short = self._short_sequence(cap, args, kwargs)
        if plain_when_short and short is not None and self.plan in _EXACT_AT_ONE_STEP:
            entry = compile_graph(cap.gm, example, "none", {}, captured=cap, backend=self.backend)
            entry.extras["short_sequence"] = (
                f"the time axis has {short} step(s): nothing to shard or chunk, so this call runs "
                f"plain autograd, which plan {self.plan!r} equals at this length")
            return entry
        return compile_graph(cap.gm, example, self.plan, self.options,
                             captured=cap, time_axis=self.time_axis, backend=self.backend, stop_after=stop_after)

    def _short_sequence(self, cap: Captured, args: tuple, kwargs: dict) -> int | None:
        """The time length of these inputs when it is 0 or 1, judged by the time axis an
        earlier specialisation found (or ``time_axis``); None otherwise or when unknown."""
        new = cap.flat_inputs(args, kwargs)
        axes: list[tuple[int, int]] = [self.time_axis] if self.time_axis is not None else []
        for entry in self._cache.values():
            if entry.captured is not None:
                n = entry.captured.num_state
                axes += [(i - n, d) for i, d in entry.ctx.input_time_dims.items() if i >= n]
        for i, d in axes:
            x = new[i] if i < len(new) else None
            if isinstance(x, torch.Tensor) and x.dim() > d and x.shape[d] <= 1:
                return int(x.shape[d])
        return None

    def register_specializer(self, serve: Specializer) -> None:
        """Consult ``serve(cm, args, kwargs)`` on every cache miss before capturing again; it
        returns a :class:`CompiledGraph` for these inputs, or None to capture as usual."""
        if serve not in self._specializers:
            self._specializers.append(serve)

    # ---------------------------------------------------------------- inspection

    def _entry(self) -> CompiledGraph:
        if self._last is None:
            raise GradshardError("the module has not been called yet: gradshard captures at the "
                                 "first call (call it once with example inputs, then inspect)")
        return self._last

    @property
    def specializations(self) -> tuple[CompiledGraph, ...]:
        """Every cached specialisation, oldest first."""
        return tuple(self._cache.values())

    def specializations_like(self, args: tuple, kwargs: dict) -> tuple[CompiledGraph, ...]:
        """The cached specialisations, then the probes compiled only through the plan's
        length-generic passes, that were compiled while the modules' state (parameter and buffer
        names, shapes, dtypes, devices, ``requires_grad``; training flags) was what it is for
        this call: the ones a specialiser may serve these inputs from, newest first."""
        state = self._key(args, kwargs)[1]
        return tuple(e for store in (self._cache, self._probes) for k, e in reversed(store.items()) if k[1] == state)

    @property
    def current(self) -> CompiledGraph:
        """The specialisation the last call ran (capture, rewritten graph, program, records)."""
        return self._entry()

    @property
    def regions(self) -> tuple[Region, ...]:
        return self._entry().regions

    @property
    def program(self) -> Program:
        return self._entry().program

    @property
    def passes(self) -> tuple[PassRecord, ...]:
        return self._entry().records

    @property
    def graph(self) -> fx.GraphModule:
        return self._entry().gm

    def trace(self, index: int | str = -1) -> str:
        """Code of the graph after pass ``index`` (an int or a pass name)."""
        recs = self.passes
        if isinstance(index, str):
            matches = [r for r in recs if r.name == index]
            if not matches:
                raise GradshardError(f"no pass named {index!r}; passes: {[r.name for r in recs]}")
            return matches[-1].after
        return recs[index].after if recs else self._entry().original.code

    # ---------------------------------------------------------------- partial updates

    def _partial(self) -> Any:
        api = self.__dict__.get("_partial_api")
        if api is None:
            raise GradshardError("parameter slices exist for plan='partial_update' only, after the "
                                 f"first call (this module uses plan={self.plan!r})")
        return api

    def parameter_slices(self) -> dict[str, tuple[str, tuple[int, int, int]]]:
        """``{slice_name: (original_name, (dim, start, stop))}``; ``slice_name`` is in
        ``named_parameters()``, ``original_name`` the user's qualified name (partial_update)."""
        return self._partial().parameter_slices()

    def full_parameters(self, names: Any = None) -> dict[str, torch.Tensor]:
        """Full (unsliced) parameter values under the user's names (partial_update)."""
        return self._partial().full_parameters(names)

    def load_full_parameters(self, params: dict[str, torch.Tensor]) -> None:
        """Write full parameter values back into the slices (partial_update)."""
        return self._partial().load_full_parameters(params)

    def explain(self) -> str:
        """A human summary: plan, regions with source lines, passes, and the stage program."""
        e = self._entry()
        spec = get_plan(e.plan)
        lines = [f"gradshard plan {e.plan!r} ({spec.gradient}); options: {e.options}"]
        lines.append(f"captured {e.original.num_nodes} nodes via the {e.captured.frontend if e.captured else 'dynamo'} front door")
        if "short_sequence" in e.extras:
            lines.append(e.extras["short_sequence"])
        if "run_eagerly" in e.extras:
            lines.append(e.extras["run_eagerly"])
        if "respecialized_from" in e.extras:
            batch = (f", batch {e.extras['batch']}" if "batch" in e.extras else "",
                     f", batch {e.extras['batch_from']}" if "batch" in e.extras else "")
            lines.append(f"serving T={e.extras['seq_len']}{batch[0]}: the program compiled at "
                         f"T={e.extras['respecialized_from']}{batch[1]}, re-specialised (no new capture); "
                         "the graph, passes and program below are the re-specialised ones")
        if "recaptured_because" in e.extras:
            lines.append(f"captured again because {e.extras['recaptured_because']}")
        if "probe_did_not_serve" in e.extras:
            lines.append(e.extras["probe_did_not_serve"])
        if e.captured is not None and e.captured.buffer_updates:
            names = [e.captured.buffer_names[i] for i in e.captured.buffer_updates]
            lines.append(f"buffers updated in forward (written back once per call): {', '.join(names)}")
        substituted = e.captured.gm.meta.get("gs_substituted") if e.captured else None
        if substituted:
            lines.append(f"substituted traceable twins for: {', '.join(substituted)}")
        lines.append(f"regions ({len(e.regions)}):")
        lines += [f"  - {r.describe()}" for r in e.regions] or ["  (none)"]
        lines.append("passes:")
        for r in e.records:
            change = f"changed: +{len(r.created)} -{len(r.erased)} nodes" if r.changed else "analysis"
            lines.append(f"  - {r.name} ({change}, {r.seconds * 1e3:.1f} ms): {r.doc}")
            lines += [f"      {n}" for n in r.notes]
        if isinstance(e.extras.get("inductor"), ComposedGraph) and e.extras["inductor"].source is e.gm:
            lines.append(e.extras["inductor"].describe())
        lines.append("program: " + e.program.describe())
        return "\n".join(lines)


def compile(model_or_fn: nn.Module | Callable[..., Any], plan: str = "none", *, frontend: str = "python",
            time_axis: tuple[int, int] | None = None, backend: str | None = None,
            cache_size: int = DEFAULT_CACHE_SIZE, inductor: bool = False, **options: Any) -> CompiledModule:
    """Compile ``model_or_fn`` with ``plan`` (see ``gs.plans()`` and docs/DESIGN.md for options).

    ``frontend`` picks the capture front door (``"python"``, ``"fx"``, ``"dynamo"``);
    ``time_axis=(input_index, dim)`` overrides time-axis inference; ``backend`` forces the
    kernel backend (``"torch"`` or ``"triton"``; default: Triton on CUDA, torch elsewhere);
    ``cache_size`` bounds the specialisations kept (least recently used dropped first);
    ``inductor=True`` compiles the segments the plan does not rewrite with Inductor, forward
    and backward (regions run as they are; :mod:`gradshard.compose`).
    """
    return CompiledModule(model_or_fn, plan, frontend=frontend, time_axis=time_axis, backend=backend,
                          cache_size=cache_size, inductor=inductor, **options)


def _check_compile_args(frontend: Any, time_axis: Any, backend: Any, cache_size: Any) -> None:
    """Validate ``gs.compile``'s own arguments when it is called, not at the first call."""
    if frontend not in FRONTENDS:
        raise GradshardError(f"unknown frontend {frontend!r}; choose one of {FRONTENDS}")
    if time_axis is not None and not (isinstance(time_axis, tuple) and len(time_axis) == 2
                                      and all(isinstance(v, int) and not isinstance(v, bool) for v in time_axis)):
        raise GradshardError(f"time_axis must be a tuple (input_index, dim) of ints, got {time_axis!r}")
    if backend not in (None, "torch", "triton"):
        raise GradshardError(f"backend must be 'torch', 'triton' or None, got {backend!r}")
    if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
        raise GradshardError(f"cache_size must be a positive int, got {cache_size!r}")


def _guard_change(old: tuple, new: tuple) -> str:
    """Which guard failed between two cache keys, in words."""
    (old_in, old_state), (new_in, new_state) = old, new
    if old_in != new_in:
        if len(old_in) != len(new_in) or old_in[0] != new_in[0]:
            return "the inputs changed (structure)"
        diffs = [_leaf_change(i, a, b) for i, (a, b) in enumerate(zip(old_in[1:], new_in[1:])) if a != b]
        return "the inputs changed (" + "; ".join(diffs[:2]) + ")"
    olds = {k[0]: k for k in old_state if isinstance(k, tuple) and k and isinstance(k[0], str)}
    news = {k[0]: k for k in new_state if isinstance(k, tuple) and k and isinstance(k[0], str)}
    changed = sorted(n for n in olds.keys() | news.keys() if olds.get(n) != news.get(n))
    if changed:
        return "parameters/buffers changed (" + ", ".join(changed[:3]) + ": added, removed, or new shape, dtype, device or requires_grad)"
    return "a module's training mode changed (train()/eval())"


def _leaf_change(i: int, old: Any, new: Any) -> str:
    """One flattened input's guard change, in words (``guard_key``'s leaf records)."""
    if old[0] == new[0] == "T":
        names = ("shape", "dtype", "device", "requires_grad")
        parts = [f"{n} {tuple(a) if n == 'shape' else a} -> {tuple(b) if n == 'shape' else b}"
                 for n, a, b in zip(names, old[1:], new[1:]) if a != b]
        return f"input {i}: " + ", ".join(parts)
    return f"input {i}: {old[1]!r} -> {new[1]!r}"


def backend(plan: str = "none", *, kernel_backend: str | None = None, inductor: bool = True,
            **options: Any) -> Callable[[fx.GraphModule, list], Callable[..., Any]]:
    """A ``torch.compile`` backend running gradshard's pipeline on Dynamo's graph.

    ``torch.compile(model, backend=gs.backend(plan="adjoint", shard_size=128))``. Dynamo
    lifts parameters to graph inputs, so gradients reach the model's own parameters.
    The segments the plan does not rewrite are compiled by Inductor, forward and backward
    (``inductor=False``: the rewritten graph runs eagerly). The compiled graphs are kept on
    the returned function's ``compiled`` list.
    """
    get_plan(plan).make_options(**options)
    if not isinstance(inductor, bool):
        raise GradshardError(f"inductor must be True or False, got {inductor!r}")
    compiled: list[CompiledGraph] = []

    def compile_fn(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if any(not isinstance(x, torch.Tensor) for x in example_inputs):
            raise GradshardError("gs.backend needs static shapes: use torch.compile(..., dynamic=False)")
        kept: list[fx.GraphModule] = []
        with _leftovers_dropped(lambda: kept):
            aten_gm = capture_graph_module(gm, example_inputs)
            entry = compile_graph(aten_gm, example_inputs, plan, options, backend=kernel_backend)
            kept.append(entry.gm)
        if inductor:
            entry = _with_inductor(entry)
        compiled.append(entry)

        def run(*args: Any) -> Any:
            return tuple(entry(*args))

        return run

    compile_fn.compiled = compiled  # type: ignore[attr-defined]
    return compile_fn
