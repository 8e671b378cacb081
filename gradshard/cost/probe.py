"""Probes: run one compiled training step on fake tensors and record what it costs.

The cost model is fitted to *probes*: the compiled program (``gs.compile(model, plan)``,
the same capture, passes and schedule a real run uses) executed on
:class:`~torch._subclasses.fake_tensor.FakeTensor` s at a few small ``(batch, seq_len)``
sizes. Fake tensors carry shapes, dtypes, devices and storages but no data, so a probe
allocates nothing and computes nothing, yet every op dispatches exactly as it would on the
real device (``F.scaled_dot_product_attention`` still picks the CPU flash kernel on a CPU
tensor, views still share storages, autograd still saves and frees the same tensors).

A probe records, with the same counting rules as :func:`gradshard.measure.measure`:

- ``live``: the live-bytes timeline after every op (a
  :class:`~gradshard.measure.LiveTensorTracker`), hence the peak;
- ``saved_bytes``: distinct storages autograd saved for backward that the step allocated;
- forward and backward FLOPs (``torch.utils.flop_counter``; ops run by the autograd engine
  are backward);
- ``retained_bytes``: what is still alive after the step (the new ``.grad`` tensors);
- ``first_step``: the same module's *first* step, run before the priced one: the compile its
  first call runs (capture, passes, self-checks), then the step (:class:`FirstStepSample`;
  :mod:`gradshard.cost.first_step` fits it). :func:`run_compile_probe` runs the compile alone.

The step is ``loss = loss_fn(compiled(*inputs)); loss.backward()`` with
:func:`default_loss` unless the caller gives one. Inputs are resized along their time and
batch axes (found by the time-locality analysis on a capture at the example sizes) by
repeating their entries, so token ids stay valid. Models whose Python code depends on
tensor *values* (boolean masks, ``nonzero``) cannot run on fake tensors; they need
``mode="real"``. Small models (``REAL_PROBE_MAX_BYTES``) are probed on real tensors by
default: at probe sizes their real step is faster than fake-tensor dispatch, and counts the
same bytes (the probe and ``gs.measure`` agree exactly either way).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import summary
from ..passes.respecialize_memo import fresh_memo
from ..capture import capture, flatten_output
from ..measure import LiveTensorTracker, SavedTensorRecorder, StepFlopCounter, record_saved  # gs.measure's instruments
from .inputs import (CostProbeError, InputAxes, fake_clone, find_input_axes, real_clone, resize_inputs,
                     tensor_leaves)

__all__ = ["InputAxes", "ProbeSample", "FirstStepSample", "CompileSample", "CostProbeError", "default_loss",
           "find_input_axes", "resize_inputs", "fake_clone", "make_step", "run_probe", "run_compile_probe",
           "collector_held", "older_objects_frozen", "REAL_PROBE_MAX_BYTES"]

# "auto" probes models with at most this much state on real tensors: at probe sizes a real
# step of a small model is faster than the fake-tensor dispatch, and exactly what runs.
REAL_PROBE_MAX_BYTES = 64 << 20




# --------------------------------------------------------------------------- the step


def default_loss(out: Any) -> torch.Tensor:
    """The scalar the priced step backpropagates from a model output.

    The sum of the output's scalar floating-point leaves that require grad (a loss, e.g.
    ``CausalLMOutput.loss``); if there are none, the sum of ``.sum()`` of every floating
    leaf that requires grad (``logits.sum()``).
    """
    leaves, _ = flatten_output(out)
    grads = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not grads:
        raise CostProbeError("the model output has no floating-point tensor that requires grad: nothing to "
                             "backpropagate. Pass loss_fn=... to gs.cost to say what the step differentiates.")
    scalars = [t for t in grads if t.numel() == 1]
    use = scalars or grads
    loss = use[0].sum()
    for t in use[1:]:
        loss = loss + t.sum()
    return loss


def make_step(module: Callable[..., Any], loss_fn: Callable[[Any], torch.Tensor] | None = None
              ) -> Callable[..., torch.Tensor]:
    """``step(*inputs)``: forward, the priced loss, backward; returns the detached loss.

    The measurement side of the cost model's validation runs exactly this step, so
    ``gs.measure(make_step(cm), *inputs)`` measures what ``gs.cost`` predicts.
    """
    loss_of = loss_fn or default_loss

    def step(*inputs: Any) -> torch.Tensor:
        loss = loss_of(module(*inputs))
        loss.backward()
        return loss.detach()

    return step


# --------------------------------------------------------------------------- recording


@dataclass(frozen=True)
class FirstStepSample:
    """The first step of a fresh compiled module, as :func:`gradshard.measure.measure` counts it
    (bytes above the pre-step baseline): the compile its first call runs (capture, passes,
    self-checks, schedule), then the step.

    ``compile_*``: the compile alone; ``compile_retained_bytes``: what it leaves alive into the
    step (the captured and rewritten graphs' fake tensors, caches)."""

    peak_bytes: int
    allocated_bytes: int
    flops: int
    compile_peak_bytes: int
    compile_allocated_bytes: int
    compile_flops: int
    compile_retained_bytes: int


@dataclass(frozen=True)
class ProbeSample:
    """What one step cost at ``(batch, seq_len)`` (bytes above the pre-step baseline)."""

    batch: int
    seq_len: int
    peak_bytes: int
    saved_bytes: int
    retained_bytes: int
    allocated_bytes: int
    flops_fwd: int
    flops_bwd: int
    state_bytes: int
    trainable_bytes: int
    input_bytes: int
    peak_phase: str
    mode: str
    ops: tuple[str, ...]
    live: tuple[int, ...]
    regions: tuple[Any, ...] = ()
    phase_peaks: tuple[int, int] = (0, 0)  # (forward, backward) peaks
    first_step: FirstStepSample | None = None  # the module's first step (compile included)


def _state_of(cm: Any) -> tuple[int, int]:
    """``(bytes of every distinct state storage the compiled step reads, of those requiring grad)``.

    State: the captured parameters and buffers plus what the rewrite installed on the graph
    module (e.g. the trainable and frozen slices of ``partial_update``); views of one storage
    count once.
    """
    entry = getattr(cm, "_last", None)
    cap = getattr(entry, "captured", None)
    if cap is None:
        return 0, 0
    seen: set[int] = set()
    total = trainable = 0
    for t in [*cap.params, *cap.buffers, *entry.gm.parameters(), *entry.gm.buffers()]:
        st = t.untyped_storage()
        if st._cdata in seen:
            continue
        seen.add(st._cdata)
        total += st.nbytes()
        trainable += st.nbytes() if t.requires_grad else 0
    return total, trainable


def run_probe(target: Any, example_inputs: Sequence[Any], *, plan: str, options: dict[str, Any],
              axes: InputAxes, batch: int, seq_len: int, loss_fn: Callable[[Any], torch.Tensor] | None = None,
              time_axis: tuple[int, int] | None = None, frontend: str = "python",
              mode: str = "auto", dtype: torch.dtype | None = None,
              context: Callable[[], Any] | None = None) -> ProbeSample:
    """Run the compiled step of ``plan`` at ``(batch, seq_len)`` on fake tensors (see module doc).

    ``mode``: ``"fake"``, ``"real"`` or ``"auto"`` (real tensors for models with at most
    :data:`REAL_PROBE_MAX_BYTES` of state, where that is faster; fake tensors otherwise).
    ``dtype``: cast floating-point state and inputs first. ``context``: a factory of a
    context manager entered around the priced step (e.g. SpaCO's chunk selection).
    """
    if mode not in ("auto", "fake", "real"):
        raise ValueError(f"probe mode must be 'auto', 'fake' or 'real', got {mode!r}")
    inputs = resize_inputs(example_inputs, axes, batch, seq_len)
    if mode == "auto":
        mode = "real" if _state_bytes(target, inputs) <= REAL_PROBE_MAX_BYTES else "fake"
    if mode == "real":
        return _probe_once(target, inputs, plan, options, batch, seq_len, loss_fn, time_axis, frontend, False, dtype,
                           context)
    try:
        return _probe_once(target, inputs, plan, options, batch, seq_len, loss_fn, time_axis, frontend, True, dtype,
                           context)
    except CostProbeError:
        raise
    except Exception as exc:
        raise CostProbeError(
            f"plan {plan!r} could not run on fake tensors at batch={batch}, seq_len={seq_len}: "
            f"{summary(exc)}\n  why: the model or the "
            "plan's runtime reads tensor values (e.g. boolean-mask indexing), which fake tensors do not have.\n"
            "  instead: pass probe_mode='real' to gs.cost (runs the small probe sizes for real), or make the "
            "value-dependent code a tensor op (torch.where)."
        ) from exc


def _grad_step(cm: nn.Module, loss_fn: Callable | None) -> Callable[..., torch.Tensor]:
    """The priced step for fake tensors: gradients via ``autograd.grad`` instead of ``.backward()``.

    ``.backward()`` hands a leaf's first gradient to ``.grad`` without a copy when nothing
    else references it; a fake tensor is a Python tensor subclass, whose Python object always
    holds a reference, so ``AccumulateGrad`` would clone instead and the probe would see a
    transient copy of every parameter gradient that a real step never allocates.
    ``autograd.grad`` returns the same gradient buffers without ``AccumulateGrad``; holding
    them until the step ends is what ``.grad`` does in the real step.
    """
    loss_of = loss_fn or default_loss

    def step(*inputs: Any) -> torch.Tensor:
        seen: set[int] = set()
        leaves = []
        cap = cm.current.captured
        for t in [*cap.params, *cm.parameters(), *tensor_leaves(inputs)]:
            if t.requires_grad and t.is_leaf and id(t) not in seen:
                seen.add(id(t))
                leaves.append(t)
        loss = loss_of(cm(*inputs))
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        step.grads = grads  # type: ignore[attr-defined]  # alive until the probe reads the tracker
        return loss.detach()

    return step


def _state_bytes(target: Any, inputs: Any) -> int:
    mods = [m for m in pytree.tree_leaves((target, inputs)) if isinstance(m, nn.Module)]
    seen: set[int] = set()
    total = 0
    for m in mods:
        for t in [*m.parameters(), *m.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def _probe_once(target: Any, inputs: tuple, plan: str, options: dict[str, Any], batch: int, seq_len: int,
                loss_fn: Callable | None, time_axis: tuple[int, int] | None, frontend: str,
                fake: bool, dtype: torch.dtype | None, context: Callable[[], Any] | None) -> ProbeSample:
    from ..api import compile as gs_compile

    originals: dict[int, torch.Tensor] = {}
    if fake:
        fmode = FakeTensorMode(allow_non_fake_inputs=True)
        ftarget, finputs = fake_clone((target, inputs), fmode, originals, dtype)
    else:
        ftarget, finputs = real_clone((target, inputs), dtype)
    cm = gs_compile(ftarget, plan, frontend=frontend, time_axis=time_axis, **options)
    input_bytes = sum(t.numel() * t.element_size() for t in tensor_leaves(finputs))
    device = next((t.device for t in tensor_leaves(finputs)), torch.device("cpu"))
    step = _grad_step(cm, loss_fn) if fake else make_step(cm, loss_fn)
    # The first step (capture + passes + self-checks + the step), priced as gs.measure sees it;
    # it also sets up what runtimes cache at their first call, so the step priced below is a
    # later, steady-state step.
    first = _first_step(cm, step, finputs, originals if fake else None, device, context)
    _clear_grads(cm, step)
    state, trainable = _state_of(cm)
    tracker = LiveTensorTracker(device=device, timeline=True)
    saved = SavedTensorRecorder(tracker)
    flops = StepFlopCounter()
    with contextlib.ExitStack() as stack:
        if context is not None:
            stack.enter_context(context())
        with tracker, flops, record_saved(saved):
            step(*finputs)
    timeline = tracker.timeline
    return ProbeSample(
        batch=batch, seq_len=seq_len, peak_bytes=tracker.peak_bytes, saved_bytes=saved.activation_bytes,
        retained_bytes=tracker.live_bytes, allocated_bytes=tracker.allocated_bytes,
        flops_fwd=flops.forward_flops, flops_bwd=flops.backward_flops,
        state_bytes=state, trainable_bytes=trainable, input_bytes=input_bytes,
        peak_phase=tracker.peak_phase, mode="fake" if fake else "real",
        ops=tuple(s.op for s in timeline if not s.op.startswith("prim.")),
        live=tuple(s.live_bytes for s in timeline if not s.op.startswith("prim.")),
        regions=tuple(cm.current.regions),
        phase_peaks=(max((s.live_bytes for s in timeline if s.phase == "forward"), default=0),
                     max((s.live_bytes for s in timeline if s.phase == "backward"), default=0)),
        first_step=first,
    )


@fresh_memo()  # the compile of a fresh process: nothing propagated before it
def _first_step(cm: Any, step: Callable[..., torch.Tensor] | None, inputs: tuple,
                real_values: dict[int, torch.Tensor] | None, device: torch.device,
                context: Callable[[], Any] | None) -> FirstStepSample:
    """Instrument the compiled module's first step: the compile its first call runs, then ``step``
    (``None``: the compile only).

    The compile is :meth:`CompiledModule.compile_first`, what ``cm(*inputs)`` runs on a cache
    miss, with ``real_values`` for the passes on fake-tensor probes. Counted as
    :func:`gradshard.measure.measure` counts a real first step: every real storage dispatched on
    the device, no fake tensor of the compile (its traces allocate nothing), and every FLOP, with
    the garbage collector held off (:func:`collector_held`). On a fake probe the step after the
    compile runs on fake tensors that stand for real ones, so they count again from there.
    """
    tracker = LiveTensorTracker(device=device, count_fake=False)
    flops = StepFlopCounter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(collector_held())
        if context is not None:
            stack.enter_context(context())
        with tracker, flops:
            cm.compile_first(inputs, {}, real_values=real_values)
            compile_peak, compile_alloc = tracker.peak_bytes, tracker.allocated_bytes
            compile_flops, retained = flops.get_total_flops(), tracker.live_bytes
            if step is not None:
                tracker.set_count_fake(real_values is not None)
                step(*inputs)
    return FirstStepSample(peak_bytes=tracker.peak_bytes, allocated_bytes=tracker.allocated_bytes,
                           flops=flops.get_total_flops(), compile_peak_bytes=compile_peak,
                           compile_allocated_bytes=compile_alloc, compile_flops=compile_flops,
                           compile_retained_bytes=retained)


@contextlib.contextmanager
def collector_held() -> Any:
    """Collect garbage now, then hold the cyclic garbage collector off until exit.

    A first step's peak depends on when the collector frees the cycles compiling leaves (fx
    graphs and their fake tensors); held off, the peak is the bound with nothing collected early,
    the same on every run. The cost model prices the first step this way, and its validation
    measures it this way."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextlib.contextmanager
def older_objects_frozen() -> Any:
    """Collect garbage, then keep every object alive now out of the collector's scans until exit.

    Each priced first step starts with a full collection (:func:`collector_held`), whose time is
    proportional to every tracked object in the process (torch alone holds some 250k): about
    0.2 s a probe, a quarter of a ``gs.cost``. Frozen (``gc.freeze``), the objects that were
    alive before the probes are skipped, so those collections scan only what the probes made.
    Nothing measured changes: the collector is held off during every priced step anyway, and
    a frozen object that dies meanwhile is collected once unfrozen. Does nothing if something
    else froze objects already (the caller's freeze is left as it is)."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass(frozen=True)
class CompileSample:
    """The compile alone at ``(batch, seq_len)`` (see :func:`run_compile_probe`)."""

    batch: int
    seq_len: int
    first_step: FirstStepSample


@fresh_memo()  # the compile of a fresh process: nothing propagated before it
def run_compile_probe(target: Any, example_inputs: Sequence[Any], *, plan: str, options: dict[str, Any],
                      axes: InputAxes, batch: int, seq_len: int, time_axis: tuple[int, int] | None = None,
                      frontend: str = "python", mode: str = "auto", dtype: torch.dtype | None = None,
                      context: Callable[[], Any] | None = None) -> CompileSample:
    """What a fresh compiled module's first call compiles at ``(batch, seq_len)``, without the
    step (the cost model prices the compile of plans served at other lengths this way)."""
    from ..api import compile as gs_compile

    inputs = resize_inputs(example_inputs, axes, batch, seq_len)
    if mode == "auto":
        mode = "real" if _state_bytes(target, inputs) <= REAL_PROBE_MAX_BYTES else "fake"
    originals: dict[int, torch.Tensor] = {}
    if mode == "fake":
        fmode = FakeTensorMode(allow_non_fake_inputs=True)
        ftarget, finputs = fake_clone((target, inputs), fmode, originals, dtype)
    else:
        ftarget, finputs = real_clone((target, inputs), dtype)
    cm = gs_compile(ftarget, plan, frontend=frontend, time_axis=time_axis, **options)
    device = next((t.device for t in tensor_leaves(finputs)), torch.device("cpu"))
    first = _first_step(cm, None, finputs, originals if mode == "fake" else None, device, context)
    return CompileSample(batch, seq_len, first)


def _clear_grads(cm: Any, step: Any) -> None:
    """Drop what the first step left (``.grad``, held gradients) so the next step starts clean."""
    cap = cm.current.captured
    for p in [*cm.parameters(), *(cap.params if cap is not None else ())]:
        p.grad = None
    if hasattr(step, "grads"):
        del step.grads
