"""Serve a plan at a new sequence length without capturing again.

A plan captures per input signature, and a model written as a per-step Python loop is
unrolled ``T`` steps at capture (HF Mamba's slow path: a first step of 89-140 s and up to
8 GB of Python heap at T=1024). The pipeline of a plan served this way (seco, spaco, none,
partial_update) is in two parts, split by :func:`record_length_generic`:

1. *length-generic*: capture, the mask simplification, the time analysis, the loop rolling
   (an unrolled loop becomes one scan or one carried loop, whatever the length), and for the
   chunked plans the recurrence rewrites (``rewrite_delta_rule_blocks``,
   ``canonicalize_recurrences``). What they leave has ``T`` only in integer arguments (view
   sizes, slice bounds, ``arange`` ends).
2. *per length*: detection and the plan's own work (the chunk planner and ``rewrite_chunked``;
   partial_update's slicing), then kernel lowering.

Plans that run a loop as captured (none, partial_update: no rolling) keep no graph that holds
an unrolled loop; they record :class:`UnrolledLoop` instead. partial_update captures such a
model at each length; plain autograd (none) runs the module itself at a new length
(:func:`gradshard.plans.none.serve_or_run_eagerly`).

:func:`record_length_generic` (a pass, between the two parts) keeps a copy of the graph and
its time facts (:func:`gradshard.passes.respecialize.time_facts`). A first call longer than
twice :data:`PROBE_LENGTH` is compiled at the probe length (``CompiledModule._compile_probe``)
and then :func:`serve_new_length` serves it: it re-specialises the kept graph to the new
``T`` (:func:`gradshard.passes.respecialize.respecialize`, which verifies every node's shape by
fake-tensor propagation) and runs part 2 on it. Capture and the length-generic passes thus
cost the same at every ``T``, and a loop-written model unrolls the probe's steps, not ``T``.

Batch: when every time-carrying input has the same batch size ``B >= 2`` on dim 0 (and ``B``
is not ``T``), the time facts also mark the dims in that batch's class, and a call at another
batch size (with or without another length) is served the same way. A batch of one cannot be
told from a broadcast dim, so a graph captured at batch 1 serves batch 1 only; the adjoint
plans (:mod:`gradshard.plans.adjoint.generic`) serve new lengths only. Either way a new batch
that is not served compiles a new probe, not a full-length capture.

Exactness: as the adjoint plan's specialiser does, the first time a kept graph serves
another length (another batch; both) it is re-specialised to the probe length plus one (the
batch plus one; both) and checked against a real capture there (same passes, the call's inputs
cut to those sizes, forward values compared); a graph that fails the check, or a
re-specialisation refused by the shape verification, is not served from (another entry may be,
else the call compiles a new probe or captures at its own sizes).

Sizes computed in Python: a model may compute sizes from ``T`` that no time fact follows
(transformers' Mamba-2 pads time to a multiple of its chunk, ``(c - T % c) % c`` steps, and
splits it into ``ceil(T / c)`` chunks). When no kept graph serves a call, the call is captured
once more with its inputs' time (and batch) dims as symbols, and the newest kept graph that
trace describes takes its integers from it (:mod:`gradshard.passes.symbolic_sizes`), serving
every length and batch size the trace's guards allow; the cross-check then runs at the shortest
length they allow. As Dynamo's automatic dynamic shapes, this happens when a second length
comes, never for the call a probe was compiled for (a symbolic trace takes several times a
capture); the last trace is kept on the compiled module, so the graph captured at its length
takes it when the next length comes. A length that breaks a guard is served by another kept
graph or captured again, and ``explain()`` names the guard and where tracing assumed it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from gradshard.analysis.dims import shape_of
from gradshard.capture import state_key
from gradshard.errors import GradshardError, first_line
from gradshard.ir import PassRecord, graph_module, is_call_input
from gradshard.passes.annotate_time import annotate_time_locality
from gradshard.passes.loop_chains import find_loops
from gradshard.passes.respecialize import RespecializeError, call_sizes, cut_call, respecialize, time_facts
from gradshard.passes.symbolic_sizes import BrokenGuard, SymbolicSizes, read_symbolic_sizes
from gradshard.pipeline import PassContext, PassResult, copy_graph, graph_pass, run_passes
from gradshard.runtime.compiled import forgetting_new_lengths

__all__ = ["PROBE_LENGTH", "LengthGeneric", "UnrolledLoop", "record_length_generic", "serve_new_length",
           "entries_at_new_length"]

log = logging.getLogger("gradshard")

#: A long first call is compiled at this many steps and served from there. A prime, as the
#: adjoint plans' probe: a length equal to a model size (64 channels) would make the
#: re-specialiser refuse, since it cannot tell the two integers apart.
PROBE_LENGTH = 67

#: ``ctx.plan_state`` key of the :class:`LengthGeneric` record.
STATE_KEY = "length_generic"
#: ``ctx.plan_state`` key of the :class:`UnrolledLoop` record.
UNROLLED_KEY = "unrolled_loop"


@dataclass
class LengthGeneric:
    """The graph the length-generic passes left, at the length (and batch) it was captured at.

    ``batch``/``batch_inputs``: the captured batch size and the inputs' batch dims, when the
    graph can serve other batch sizes too (None / empty: a new batch size is a new capture).
    ``verified``: the cross-check's verdict against a real capture, per kind of change (a new
    length, a new batch, both), shared by every entry served from this graph."""

    graph: fx.GraphModule
    facts: dict[str, tuple[Any, ...]]
    seq_len: int
    time_inputs: dict[str, int]  # placeholder name -> time dim
    batch: Optional[int] = None
    batch_inputs: dict[str, int] = dataclasses.field(default_factory=dict)  # placeholder name -> batch dim
    verified: dict[tuple[bool, bool], bool] = dataclasses.field(default_factory=dict)
    #: Sizes the time facts cannot follow, from a symbolic trace (module doc, "Sizes computed in Python").
    symbolic: Optional[SymbolicSizes] = None
    #: Why a symbolic trace could not describe this graph (not tried again).
    symbolic_refused: Optional[str] = None

    def sizes(self) -> tuple[int, Optional[int]]:
        return self.seq_len, self.batch


@dataclass(frozen=True)
class UnrolledLoop:
    """A graph the length-generic passes left with a per-step loop unrolled ``seq_len`` times:
    not kept (its size grows with ``T``); ``graph`` is read for its placeholders only."""

    graph: fx.Graph
    seq_len: int
    time_inputs: dict[str, int]  # placeholder name -> time dim
    loops: int


@graph_pass
def record_length_generic(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Keep the graph and its time facts so another length can be served from it (analysis).

    Everything before this pass is length-generic (see the module doc); the planner and the
    rewrite after it run again at a served length."""
    tl = ctx.analyses.get("time")
    inputs = _input_time_dims(gm, tl)
    lengths = {int(shape_of(ph)[d]) for ph, d in inputs.items()} if inputs else set()
    if len(lengths) != 1 or min(lengths) < 2:
        return PassResult(gm, notes=("the inputs have no common time axis of two or more steps: new lengths "
                                     "are captured again",))
    T = lengths.pop()
    loops = find_loops(gm, tl)
    if loops:  # plans that run loops as captured (none, partial_update) leave them unrolled
        ctx.plan_state[UNROLLED_KEY] = UnrolledLoop(gm.graph, T, {ph.name: d for ph, d in inputs.items()},
                                                    len(loops))
        return PassResult(gm, notes=(f"the graph holds {len(loops)} per-step loop(s) unrolled {T} times: not "
                                     "kept for other lengths",))
    B, batch_inputs = _input_batch_dims(inputs, tl, T)
    facts = time_facts(gm, tl, T, batch_inputs)
    for ph in gm.graph.find_nodes(op="placeholder"):
        if ph not in inputs and ph.name in facts:  # parameters, buffers (a RoPE table): same at any length
            facts[ph.name] = (None,) * len(facts[ph.name])
    kept = graph_module(gm, copy_graph(gm), gm.__class__.__name__)
    ctx.plan_state[STATE_KEY] = LengthGeneric(kept, facts, T, {ph.name: d for ph, d in inputs.items()}, B, batch_inputs)
    also = (f" or another batch size (captured at {B})" if B is not None else
            " (a new batch size is captured again: the inputs have no batch dim of two or more rows apart from time)")
    return PassResult(gm, notes=(f"kept the {len(kept.graph.nodes)}-node graph at T={T}: a call at another length"
                                 f"{also} re-specialises it and plans again, without a new capture",))


def _input_batch_dims(inputs: dict[fx.Node, int], tl: Any, T: int) -> tuple[Optional[int], dict[str, int]]:
    """The batch size and the batch dim (dim 0) of each time-carrying input, when every one of
    them has the same size ``B`` >= 2 there, ``B`` is not ``T``, and that dim is not on the time
    axis; else ``(None, {})``. A batch of one cannot be told from a broadcast dim, and a size
    equal to ``T`` from the time axis, so such a graph serves its own batch size only."""
    sizes = {int(shape_of(ph)[0]) for ph, d in inputs.items() if d != 0 and len(shape_of(ph)) > 1}
    if len(sizes) != 1 or any(d == 0 for d in inputs.values()):
        return None, {}
    B = sizes.pop()
    batch = {ph.name: 0 for ph in inputs}
    if B < 2 or B == T or any(tl.dims.canon(tl.dims.input_labels[name][0]) == tl.time_class for name in batch):
        return None, {}
    return B, batch


def _input_time_dims(gm: fx.GraphModule, tl: Any) -> dict[fx.Node, int]:
    """The model inputs (not parameters or buffers) that carry the time axis, and its dim."""
    if tl is None:
        return {}
    out = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        d = tl.time_inputs.get(ph.name)
        if d is not None and is_call_input(ph, untagged=False) and shape_of(ph):
            out[ph] = int(d)
    return out


# --------------------------------------------------------------------------- serving


Sizes = tuple[int, Optional[int]]  # (T, B): B is None for a graph that serves its own batch only


def _new_sizes(entry: Any, lg: LengthGeneric | UnrolledLoop, args: tuple, kwargs: dict) -> Optional[Sizes]:
    """The call's ``(T, B)`` if its inputs differ from ``entry``'s only along their time dims
    (and, for a graph that serves other batch sizes, their batch dims), and it is another length
    of two or more steps or another batch (a shorter call is captured: plain autograd)."""
    cap = entry.captured
    if cap is None:
        return None
    if isinstance(lg, LengthGeneric):
        graph, batch_inputs, old = lg.graph.graph, lg.batch_inputs, lg.sizes()
    else:
        graph, batch_inputs, old = lg.graph, {}, (lg.seq_len, None)
    sizes = call_sizes(cap, graph, lg.time_inputs, batch_inputs, args, kwargs)
    if sizes is None or sizes == old or sizes[0] < 2:
        return None
    return sizes


def entries_at_new_length(cm: Any, args: tuple, kwargs: dict, key: str,
                          kind: type) -> Iterator[tuple[Any, Any, Sizes]]:
    """``(entry, record, (T_new, B_new))`` for each entry compiled in the modules' current state
    whose ``plan_state[key]`` record (a ``kind``) has inputs that differ from this call's only in
    their time length (and batch size, where the record serves other batches), newest first."""
    for entry in cm.specializations_like(args, kwargs):
        record = entry.ctx.plan_state.get(key) if entry.ctx is not None else None
        if not isinstance(record, kind) or "short_sequence" in entry.extras:
            continue
        sizes = _new_sizes(entry, record, args, kwargs)
        if sizes is not None:
            yield entry, record, sizes


def _cut(entry: Any, lg: LengthGeneric, args: tuple, kwargs: dict, sizes: Sizes) -> tuple[tuple, dict]:
    """The call's inputs cut to their first ``T`` steps along their time dims (and first ``B``
    rows along their batch dims)."""
    T, B = sizes
    return cut_call(entry.captured, lg.graph.graph, lg.time_inputs, args, kwargs, T, lg.batch_inputs, B)


def _respecialize(lg: LengthGeneric, sizes: Sizes) -> fx.GraphModule:
    """The kept graph re-specialised to ``sizes`` (verified on fake tensors), its integers
    rewritten from the time facts or, where a symbolic trace gave them, from its expressions."""
    T, B = sizes
    batch = (lg.batch, B) if lg.batch is not None and B is not None else (1, 1)
    rec = lg.symbolic
    if rec is None:
        return respecialize(lg.graph, lg.facts, lg.seq_len, T, strict_scalars=True, batch=batch)
    why = rec.failing_guard(T, B)
    if why is not None:
        raise RespecializeError(f"the symbolic trace's guard {why} is false at {_describe(sizes)}")
    return respecialize(lg.graph, {**lg.facts, **rec.facts}, lg.seq_len, T, strict_scalars=True, batch=batch,
                        rewrite_args=lambda node: rec.rewrite_args(node, T, B))


def _generic_passes(plan: str) -> list[Any]:
    """The plan's passes up to and including :func:`record_length_generic`."""
    from gradshard.plans.registry import get_plan

    passes = list(get_plan(plan).pipeline())
    names = [p.name for p in passes]
    return passes[: names.index(record_length_generic.name) + 1]


def _planning_passes(plan: str) -> list[Any]:
    """The time analysis, then the plan's passes after :func:`record_length_generic`."""
    from gradshard.plans.registry import get_plan

    passes = list(get_plan(plan).pipeline())
    names = [p.name for p in passes]
    return [annotate_time_locality, *passes[names.index(record_length_generic.name) + 1:]]


def _probe_sizes(lg: LengthGeneric, sizes: Sizes) -> Sizes:
    """Where the cross-check runs: per size that changes, one step (row) more than the kept
    graph's, or the call's own when it is smaller (the call's inputs must hold the probe)."""
    def probe(old: Optional[int], new: Optional[int]) -> Optional[int]:
        return old if new == old or new is None or old is None else (old + 1 if new > old else new)

    T, B = probe(lg.seq_len, sizes[0]), probe(lg.batch, sizes[1])
    rec = lg.symbolic
    if rec is None or rec.failing_guard(T, B) is None:
        return int(T), B
    # the symbolic trace's guards (two chunks or more, a pad that is not empty) may rule the
    # next length out: the shortest candidate they allow, at worst the call's own sizes
    for B_probe in dict.fromkeys((B, sizes[1])):
        for T_probe in _candidate_lengths(lg.seq_len, sizes[0]):
            if rec.failing_guard(T_probe, B_probe) is None:
                return T_probe, B_probe
    return sizes


def _candidate_lengths(old: int, new: int) -> list[int]:
    """Lengths in ``(old, new]`` to cross-check at, shortest first: a few steps more than
    ``old``, ``old + 1`` doubled, ``new`` halved; ``new``'s alone when it is not longer."""
    if new <= old:
        return [new]
    found = {old + 1, old + 2, old + 3, new}
    found |= {(old + 1) << i for i in range(1, 40) if (old + 1) << i <= new}
    found |= {new >> i for i in range(1, 40) if new >> i > old}
    return sorted(found)


def _cross_check(cm: Any, entry: Any, lg: LengthGeneric, args: tuple, kwargs: dict, sizes: Sizes) -> bool:
    """The kept graph re-specialised to :func:`_probe_sizes` against a real capture there, run
    through the same length-generic passes: forward values must agree."""
    from gradshard.capture import capture

    probe = _probe_sizes(lg, sizes)
    p_args, p_kwargs = _cut(entry, lg, args, kwargs, probe)
    try:
        with torch.random.fork_rng():
            cap = capture(cm.target, p_args, p_kwargs, frontend=cm.frontend)
            flat = [*cap.state(), *cap.flat_inputs(p_args, p_kwargs)]
            ctx = PassContext(plan=entry.plan, options=entry.options, example_inputs=flat, captured=cap,
                              time_axis=cm.time_axis, backend=cm.backend)
            real, _ = run_passes(cap.gm, _generic_passes(entry.plan), ctx)
            mine = _respecialize(lg, probe)
            with torch.no_grad():
                torch.manual_seed(0)
                want = real(*flat)
                torch.manual_seed(0)
                with forgetting_new_lengths(mine):
                    got = mine(*flat)
            if any(isinstance(x, FakeTensor) for x in flat):
                # the cost model prices a fake-tensor clone (the runs above are its cost): no
                # values to compare, and none reach a user; the shapes were verified
                return True
            same = _same_values(want, got)
            if not same:
                _note(cm, f"re-specialised to {_describe(probe)}, the kept graph's values differ from a capture there")
            return same
    except Exception as exc:  # noqa: BLE001 - any failure means: capture at the call's length
        _note(cm, f"the cross-check at {_describe(probe)} failed ({first_line(exc)})")
        return False


def _note(cm: Any, why: str) -> None:
    """Why a kept graph did not serve a call: logged, and kept on ``cm.serve_notes`` (a list
    the compiled module resets per compile, for ``explain()``) where there is one."""
    log.info("gradshard: not served from the kept graph: %s", why)
    notes = getattr(cm, "serve_notes", None)
    if isinstance(notes, list):
        notes.append(why)


def _describe(sizes: Sizes) -> str:
    return f"T={sizes[0]}" + (f", batch {sizes[1]}" if sizes[1] is not None else "")


def _same_values(want: Sequence[Any], got: Sequence[Any]) -> bool:
    if len(want) != len(got):
        return False
    for a, b in zip(want, got):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if not isinstance(a, torch.Tensor):
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return False
            continue
        tol = 1e-9 if a.dtype == torch.float64 else 1e-4
        if not torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True):
            return False
    return True


def _served_entry(cm: Any, entry: Any, lg: LengthGeneric, args: tuple, kwargs: dict, sizes: Sizes) -> Any:
    """The kept graph re-specialised to ``sizes``, planned and rewritten there."""
    t0 = time.perf_counter()
    gm = _respecialize(lg, sizes)
    seconds = time.perf_counter() - t0
    cap = entry.captured
    flat = [*cap.state(), *cap.flat_inputs(args, kwargs)]
    ctx = PassContext(plan=entry.plan, options=entry.options, example_inputs=flat, captured=cap,
                      time_axis=cm.time_axis, backend=cm.backend)
    ctx.plan_state[STATE_KEY] = lg
    T_new, B_new = sizes
    notes = [f"T: {lg.seq_len} -> {T_new}"] + ([f"batch: {lg.batch} -> {B_new}"] if B_new != lg.batch else [])
    if lg.symbolic is not None:
        notes.append(f"the integers of {sum(map(bool, lg.symbolic.args.values()))} nodes from a capture with symbolic sizes at "
                     f"{_describe(lg.symbolic.hint)} (its {len(lg.symbolic.guards)} guards hold here)")
    record = PassRecord(
        name="respecialize_length",
        doc=f"re-specialise the graph the length-generic passes left at {_describe(lg.sizes())} to "
            f"{_describe(sizes)} (length- and batch-dependent integers rewritten, every shape verified on "
            "fake tensors; no new capture)",
        changed=True, before=lg.graph.code, after=gm.code, created=(), erased=(),
        notes=tuple(notes), regions=(), seconds=seconds)
    out, records = run_passes(gm, _planning_passes(entry.plan), ctx)
    names = [r.name for r in entry.records]
    generic = entry.records[: names.index(record_length_generic.name) + 1]  # capture-time passes, kept
    extras = {"respecialized_from": lg.seq_len, "seq_len": T_new}
    if B_new != lg.batch:
        extras.update(batch=B_new, batch_from=lg.batch)
    # ``program`` is the probe's until CompiledModule schedules the served graph (api sits above plans)
    return dataclasses.replace(entry, gm=out, regions=tuple(ctx.regions), records=(*generic, record, *records),
                               ctx=ctx, extras=extras)


def serve_new_length(cm: Any, args: tuple, kwargs: dict) -> Optional[Any]:
    """Specialiser (``CompiledModule.register_specializer``): an entry for inputs that differ
    from a cached entry of a length-generic plan only in their time length (or batch size), or
    None to capture as usual. A kept graph whose integers its time facts cannot follow to the
    call's sizes is traced once with symbolic sizes and tried again (:func:`_trace_symbolic`)."""
    kept: list[tuple[Any, LengthGeneric, Sizes]] = []
    for entry, lg, sizes in entries_at_new_length(cm, args, kwargs, STATE_KEY, LengthGeneric):
        if all(lg is not other for _, other, _ in kept):  # entries served from one kept graph share it
            kept.append((entry, lg, sizes))
    for entry, lg, sizes in kept:
        served = _serve_from(cm, entry, lg, args, kwargs, sizes)
        if served is not None:
            return served
    # none serves as it is: the newest whose time facts (or guards) a symbolic trace corrects
    traced: dict[str, Any] = {}  # the call's symbolic capture, made at most once
    for entry, lg, sizes in kept:
        if _trace_symbolic(cm, entry, lg, args, kwargs, sizes, traced):
            served = _serve_from(cm, entry, lg, args, kwargs, sizes)
            if served is not None:
                return served
    return None


def _serve_from(cm: Any, entry: Any, lg: LengthGeneric, args: tuple, kwargs: dict, sizes: Sizes) -> Optional[Any]:
    """``entry``'s kept graph served at ``sizes`` once its change is cross-checked, or None (noted)."""
    change = (sizes[0] != lg.seq_len, sizes[1] != lg.batch)
    if change not in lg.verified:
        lg.verified[change] = _cross_check(cm, entry, lg, args, kwargs, sizes)  # notes a failure
    elif not lg.verified[change]:
        _note(cm, f"{_describe(sizes)} from {_describe(lg.sizes())}: its cross-check for this kind of change "
                  "failed at an earlier call")
    if not lg.verified[change]:
        return None  # another entry (a probe compiled at this batch) may serve it
    try:
        with torch.random.fork_rng():  # compiling must not consume the user's random stream
            served = _served_entry(cm, entry, lg, args, kwargs, sizes)
    except (RespecializeError, GradshardError) as exc:
        # a refusal at the new length is reported by the capture at that length, if it stands
        _note(cm, f"{_describe(sizes)} from {_describe(lg.sizes())}: {first_line(exc)}")
        return None
    log.info("gradshard: serving %s from the graph captured at %s (no new capture)", _describe(sizes),
             _describe(lg.sizes()))
    return served


# --------------------------------------------------------------------------- sizes computed in Python


def _trace_symbolic(cm: Any, entry: Any, lg: LengthGeneric, args: tuple, kwargs: dict, sizes: Sizes,
                    traced: dict[str, Any]) -> bool:
    """Give ``lg`` the sizes its time facts miss (a pad to a multiple of a chunk, a chunk
    count: :mod:`gradshard.passes.symbolic_sizes`) from a capture of the call with its inputs'
    time (and batch) dims as symbols (made once per call, kept in ``traced``), when it had
    none or one whose guards rule ``sizes`` out. True when it has a new one (its cross-checks
    start again).

    As Dynamo's automatic dynamic shapes: only a graph captured at a length a call asked for,
    when another length comes; not a probe's, compiled to serve the call that made it (a
    symbolic trace costs several captures: sympy reasons about every size; the call is then
    captured at its own length, and that graph traces symbolically if another length comes)."""
    if entry.extras.get("probe") or (lg.symbolic is not None and lg.symbolic.failing_guard(*sizes) is None):
        return False
    if lg.symbolic_refused is not None:
        _note(cm, f"a capture with symbolic sizes did not describe the graph kept at {_describe(lg.sizes())} "
                  f"({lg.symbolic_refused}): not tried again")
        return False
    state = state_key(cm.target, args, kwargs)
    stored = getattr(cm, "symbolic_trace", None)
    if stored is not None and stored[0] == state:
        if stored[1] == sizes:
            traced.setdefault("gm", stored[2])
        elif _install(lg, stored[2], stored[1], sizes):
            return True  # the trace of an earlier call (captured at its own length since) describes this graph
    if "gm" not in traced and "error" not in traced:
        t0 = time.perf_counter()
        try:
            traced["gm"] = _capture_symbolic(cm, entry, lg, args, kwargs)
            cm.symbolic_trace = (state, sizes, traced["gm"])
        except GradshardError as exc:
            traced["error"] = first_line(exc)
            _note(cm, f"a capture with symbolic sizes at {_describe(sizes)} failed ({traced['error']})")
        log.info("gradshard: captured with symbolic sizes at %s in %.1f s", _describe(sizes), time.perf_counter() - t0)
    if "gm" not in traced:
        return False
    try:
        return _install(lg, traced["gm"], sizes, sizes, strict=True)
    except RespecializeError as exc:
        _note(cm, f"the capture with symbolic sizes at {_describe(sizes)} does not describe the graph kept at "
                  f"{_describe(lg.sizes())} ({first_line(exc)})")
        if lg.symbolic is None and not isinstance(exc, BrokenGuard):
            lg.symbolic_refused = first_line(exc)  # a graph a trace at other sizes may describe is tried again
        return False


def _install(lg: LengthGeneric, sym: fx.GraphModule, hint: Sizes, sizes: Sizes, strict: bool = False) -> bool:
    """Read ``lg``'s symbolic sizes from ``sym`` (traced at ``hint``) and keep them, if its
    guards hold at ``sizes``; ``strict``: raise :class:`RespecializeError` instead of False."""
    try:
        rec = read_symbolic_sizes(lg.graph, sym, lg.sizes(), lg.time_inputs, lg.batch_inputs, hint)
    except RespecializeError:
        if strict:
            raise
        return False
    if rec.failing_guard(*sizes) is not None:
        return False
    lg.symbolic = rec
    lg.verified.clear()
    log.info("gradshard: the graph kept at %s takes %d nodes' integers from the capture with symbolic sizes at "
             "%s (%d guards)", _describe(lg.sizes()), sum(map(bool, rec.args.values())), _describe(hint),
             len(rec.guards))
    return True


def _capture_symbolic(cm: Any, entry: Any, lg: LengthGeneric, args: tuple, kwargs: dict) -> fx.GraphModule:
    """The call captured with its inputs' time dims (and batch dims, where ``lg`` serves other
    batch sizes) as symbols."""
    from gradshard.capture import capture

    phs = list(lg.graph.graph.find_nodes(op="placeholder"))[entry.captured.num_state:]
    dims = {i: [d for d in (lg.time_inputs.get(ph.name), lg.batch_inputs.get(ph.name)) if d is not None]
            for i, ph in enumerate(phs)}
    with torch.random.fork_rng():
        return capture(cm.target, args, kwargs, frontend=cm.frontend,
                       symbolic={i: d for i, d in dims.items() if d}).gm
