"""Measure one training step: peak memory, saved activations, FLOPs and wall time.

``measure(step_fn, *args)`` runs ``step_fn(*args, **kwargs)`` -- which must run the forward
*and* the backward itself -- and returns a :class:`Measurement`::

    m = gs.measure(lambda x: model(x).sum().backward(), x)
    m = gs.measure(gs.measure.step(lambda x: model(x).sum()), x)   # same thing
    print(m)            # peak 12 MiB | saved 8 MiB | 1.2 GFLOP (fwd 400 MFLOP, bwd 800 MFLOP) | ...

What is counted (byte counts are of tensor storages, ``untyped_storage().nbytes()``, or of
allocator blocks), all above the baseline live before the step (parameters, inputs, optimizer
state, existing ``.grad``):

- ``peak_bytes``: the most bytes live at once during the step. On CUDA: the caching allocator's
  ``max_memory_allocated()`` minus the allocation at the start (:class:`allocator.CudaPeak`).
  On CPU: the :class:`LiveTensorTracker`'s count of storages created by dispatched ops (exact,
  and the same count the cost model's probes make on fake tensors) -- unless
  ``torch.compile``'d code ran, whose buffers bypass the dispatcher: then the CPU allocator's
  own count, from ``torch.profiler``'s memory events (:class:`allocator.CpuAllocatorTrace`,
  engaged once the process has compiled anything, one thread at a time, and not while another
  profiler runs). ``peak_source`` says which; ``allocator_peak_bytes`` is the allocator's number
  whenever it was recorded, ``tracked_peak_bytes`` the tracker's; ``notes`` says what could not
  be seen.
- ``saved_bytes``: distinct storages saved for backward (``saved_tensors_hooks``) that were
  allocated during the step, i.e. activations; ``saved_bytes_total`` includes those that
  predate it (:mod:`saved`).
- ``flops``: ``torch.utils.flop_counter.FlopCounterMode`` over the whole step, with gradshard's
  custom ops and the fused CPU attention kernels registered in its formula registry
  (:mod:`flops`; the custom ops' formulas are registered by :mod:`gradshard.ops`); ``backward_flops`` are those of ops run by the
  autograd engine (including recomputation), ``forward_flops`` the rest.
- ``seconds``: median wall time of ``repeat`` uninstrumented calls (synchronized on CUDA).
  Memory and FLOPs come from one separate instrumented call.

Compiled code is measured as it runs: the instruments let ``torch.compile``'d regions run
compiled (their dispatch modes declare ``ignore_compile_internals``), nothing switches them to
eager, and ``compiled_regions`` counts how many ran. Inside them FLOPs are those of the kernels
they dispatch (extern matmuls, convolutions, attention, custom ops).

Limits: allocations that bypass both the dispatcher and the c10 allocator (``torch.from_numpy``)
are invisible; higher-order ops (``torch.cond``, scans) run below the tracker, so only their
outputs are seen; sparse tensors and tensor subclasses without a storage are skipped.
:class:`rss.PeakRss` gives the operating system's view, for validation.
"""

from __future__ import annotations

from gradshard.units import format_bytes, format_flops

from .allocator import CpuAllocatorTrace, CudaPeak
from .devices import describe_device
from .flops import StepFlopCounter
from .result import Measurement
from .rss import PeakRss
from .run import StepContractError, measure, step
from .saved import SavedTensorRecorder, active_saved_recorders, record_saved
from .tracker import LiveSample, LiveTensorTracker

__all__ = [
    "CpuAllocatorTrace",
    "CudaPeak",
    "LiveSample",
    "LiveTensorTracker",
    "Measurement",
    "PeakRss",
    "SavedTensorRecorder",
    "StepContractError",
    "StepFlopCounter",
    "active_saved_recorders",
    "describe_device",
    "format_bytes",
    "format_flops",
    "measure",
    "record_saved",
    "step",
]

# ``gs.measure`` is the function ``measure`` once the package re-exports it, so expose the helpers
# on it too: ``gs.measure.step(loss_fn)``, ``gs.measure.LiveTensorTracker``, ``gs.measure.Measurement``.
measure.step = step  # type: ignore[attr-defined]
measure.LiveTensorTracker = LiveTensorTracker  # type: ignore[attr-defined]
measure.Measurement = Measurement  # type: ignore[attr-defined]
measure.LiveSample = LiveSample  # type: ignore[attr-defined]
measure.StepContractError = StepContractError  # type: ignore[attr-defined]
