"""``measure(step_fn, *args)``: run one training step under the instruments and return a Measurement."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .allocator import CpuAllocatorTrace, CudaPeak, compilation_count, compiled_code_may_run
from .devices import describe_device, infer_device, synchronize
from .flops import StepFlopCounter
from .result import Measurement
from .saved import SavedTensorRecorder, record_saved
from .tracker import LiveTensorTracker

__all__ = ["StepContractError", "measure", "step"]


class StepContractError(ValueError):
    """``step_fn`` broke the contract of :func:`measure` (e.g. it ran no backward)."""


def _requires_grad_output(out: Any) -> bool:
    return any(
        isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
        for t in tree_leaves(out)
    )


def _notes(trace: CpuAllocatorTrace | None, compiled_during: bool, device: torch.device) -> tuple[str, ...]:
    notes = []
    if compiled_during:
        notes.append("torch.compile compiled code during the measured call: pass warmup=1 to measure a "
                     "steady step (compilation allocates, and a first compile is not traced)")
    if trace is not None and not trace.available and device.type != "cuda":
        notes.append(f"the CPU allocator could not be traced ({trace.why_unavailable}): if compiled code "
                     "ran, the peak counts only the storages its dispatched ops created")
    if trace is not None and trace.compiled_regions:
        notes.append("inside compiled regions FLOPs are those of the kernels they dispatch (matmul, "
                     "convolution, attention, custom ops), tracked_* fields cover dispatched ops only")
    return tuple(notes)


def measure(
    step_fn: Callable[..., Any],
    *args: Any,
    device: torch.device | str | None = None,
    warmup: int = 0,
    repeat: int = 1,
    **kwargs: Any,
) -> Measurement:
    """Run ``step_fn(*args, **kwargs)`` -- forward and backward -- and measure it.

    Contract: ``step_fn`` runs the backward itself (``loss.backward()`` or
    ``torch.autograd.grad``); ``measure`` never calls it for you. If ``step_fn`` returns a tensor
    that requires grad and no backward ran, :class:`StepContractError` is raised (wrap a loss
    function with :func:`step` to get a conforming ``step_fn``). To measure a forward only,
    return nothing that requires grad.

    Calls, in order: ``warmup`` untimed, unmeasured calls (compilation, autotuning, lazy init);
    one instrumented call that yields memory, saved bytes and FLOPs; ``repeat`` plain timed calls.
    Every call is a real step: gradients accumulate into ``.grad`` across calls as in a training
    loop without ``zero_grad``, so the instrumented call sees the state left by the warmup calls
    (with ``warmup=0``: the caller's state). Have ``step_fn`` zero gradients first if each call
    should start clean. ``torch.compile``'d code runs compiled in every call; give it
    ``warmup=1`` so the instrumented call is a steady step, not a compilation.

    ``device``: where to measure; default: the device of the first tensor (or module parameter)
    in ``args``/``kwargs``, else CPU. Byte counts cover storages on that device only. The keyword
    names ``device``, ``warmup`` and ``repeat`` are taken by ``measure``; everything else in
    ``kwargs`` goes to ``step_fn``.

    Exceptions from ``step_fn`` propagate unchanged, after the dispatch modes and hooks
    ``measure`` installed are removed. ``measure`` calls may be nested.
    """
    if not callable(step_fn):
        raise TypeError(f"measure: step_fn must be callable, got {type(step_fn).__name__}")
    if warmup < 0 or repeat < 0:
        raise ValueError(f"measure: warmup and repeat must be >= 0, got {warmup=} {repeat=}")
    dev = infer_device(device, args, kwargs)

    for _ in range(warmup):
        step_fn(*args, **kwargs)
    synchronize(dev)

    if dev.type == "cuda":
        # Collect garbage left by earlier code now, so the allocator does not see it freed
        # mid-step (that would lower the allocation below the starting point). The tracker
        # counts only storages allocated in the step, so it does not need this.
        gc.collect()
    trace = CpuAllocatorTrace(dev) if compiled_code_may_run() else None
    tracker = LiveTensorTracker(device=dev, count_fake=False, force_eager=False)
    recorder = SavedTensorRecorder(tracker, settle_by_address=trace is not None)
    flop_counter = StepFlopCounter()
    cuda_peak = CudaPeak(dev) if dev.type == "cuda" else None
    compilations = compilation_count()
    with contextlib.ExitStack() as instruments:
        for instrument in (trace, cuda_peak, tracker, flop_counter, record_saved(recorder)):
            if instrument is not None:
                instruments.enter_context(instrument)  # type: ignore[arg-type]
        out = step_fn(*args, **kwargs)
        needs_backward = _requires_grad_output(out)
        del out
        synchronize(dev)
    compiled_during = compilation_count() != compilations
    traced = trace is not None and trace.available
    if traced:
        recorder.settle(trace.allocated_ptrs)
    # A compiled backward may dispatch no op at all; it still unpacks what its forward saved.
    backward_ran = tracker.backward_ops > 0 or recorder.unpacked > 0 or (traced and trace.autograd_nodes > 0)
    if needs_backward and not backward_ran:
        raise StepContractError(
            "measure: step_fn returned a tensor that requires grad, but no backward pass ran. "
            "measure() does not call backward for you: make step_fn call loss.backward() "
            "(or wrap a loss function: gs.measure.step(loss_fn)), or return a detached value "
            "if only the forward should be measured."
        )

    times: list[float] = []
    for _ in range(repeat):
        synchronize(dev)
        t0 = time.perf_counter()
        step_fn(*args, **kwargs)
        synchronize(dev)
        times.append(time.perf_counter() - t0)

    compiled = traced and trace.compiled_regions > 0
    if cuda_peak is not None:
        peak, source = cuda_peak.peak_bytes, "cuda_allocator"
    elif compiled:
        peak, source = trace.peak_bytes, "cpu_allocator"
    else:
        peak, source = tracker.peak_bytes, "tracker"
    allocator_peak = cuda_peak.peak_bytes if cuda_peak is not None else (trace.peak_bytes if traced else None)
    by_op = sorted(flop_counter.flops_by_op().items(), key=lambda kv: (-kv[1], kv[0]))
    total_flops = flop_counter.get_total_flops()
    phase_peaks = tracker.phase_peak_bytes
    return Measurement(
        peak_bytes=peak,
        saved_bytes=recorder.activation_bytes,
        saved_bytes_total=recorder.total_bytes,
        flops=total_flops,
        forward_flops=total_flops - flop_counter.backward_flops,
        backward_flops=flop_counter.backward_flops,
        seconds=statistics.median(times) if times else None,
        seconds_all=tuple(times),
        device=describe_device(dev),
        device_type=dev.type,
        peak_source=source,
        tracked_peak_bytes=tracker.peak_bytes,
        retained_bytes=trace.final_bytes if compiled else tracker.live_bytes,
        allocated_bytes=trace.allocated_bytes if compiled else tracker.allocated_bytes,
        peak_op=tracker.peak_op,
        peak_phase=tracker.peak_phase,
        forward_peak_bytes=phase_peaks["forward"],
        backward_peak_bytes=phase_peaks["backward"],
        num_ops=tracker.num_ops,
        backward_ops=tracker.backward_ops,
        flops_by_op=tuple(by_op),
        allocator_peak_bytes=allocator_peak,
        compiled_regions=trace.compiled_regions if traced else None,
        notes=_notes(trace, compiled_during, dev),
    )


def step(
    loss_fn: Callable[..., torch.Tensor], *, retain_graph: bool = False
) -> Callable[..., torch.Tensor]:
    """Build a ``step_fn`` for :func:`measure` from a loss function.

    The returned function computes ``loss = loss_fn(*args, **kwargs)``, checks that it is a
    scalar tensor that requires grad, calls ``loss.backward()`` and returns ``loss.detach()``.
    """

    def step_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss = loss_fn(*args, **kwargs)
        name = getattr(loss_fn, "__qualname__", repr(loss_fn))
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"measure.step: {name} returned {type(loss).__name__}, not a tensor")
        if loss.numel() != 1:
            raise ValueError(
                f"measure.step: {name} returned a tensor of shape {tuple(loss.shape)}; "
                "it must return a scalar loss (reduce it, e.g. .sum() or .mean())"
            )
        if not loss.requires_grad:
            raise ValueError(
                f"measure.step: the loss returned by {name} does not require grad "
                "(no parameter or input in its graph requires grad, or it ran under no_grad)"
            )
        loss.backward(retain_graph=retain_graph)
        return loss.detach()

    step_fn.__qualname__ = f"step({getattr(loss_fn, '__qualname__', 'loss_fn')})"
    return step_fn
