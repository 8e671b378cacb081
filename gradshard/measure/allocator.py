"""What the allocators saw during a step: the CUDA caching allocator and the CPU allocator.

- :class:`CudaPeak`: ``torch.cuda.max_memory_allocated`` above the start of a region, safe when
  regions nest (a reset of the global peak by an inner region is folded into the outer ones).
- :class:`CpuAllocatorTrace`: every allocation and free of the c10 CPU allocator on this thread
  during a region, from ``torch.profiler``'s memory events (``profile_memory=True``): the peak
  above the start, the addresses handed out, and how many ``torch.compile``'d regions ran.
  Unlike a dispatch mode it sees the buffers compiled code allocates. It costs a profiler
  session (slow to start the first time in a process), so ``gs.measure`` uses it only when
  compiled code may run (:func:`compiled_code_may_run`); it is unavailable while another
  profiler is running or another thread traces (one session per process).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CpuAllocatorTrace", "CudaPeak", "compilation_count", "compiled_code_may_run"]


class CudaPeak:
    """Peak of ``max_memory_allocated`` above the start, surviving nested peak resets.

    ``reset_peak_memory_stats`` is global, so an inner scope resetting it would erase the peak of
    an outer one; each scope therefore folds the current peak into the enclosing scopes first.
    """

    _stack: list[CudaPeak] = []

    def __init__(self, device: torch.device):
        self.device = device
        self.start = 0
        self.carried = 0
        self.peak_bytes = 0

    def __enter__(self) -> CudaPeak:
        torch.cuda.synchronize(self.device)
        current_peak = torch.cuda.max_memory_allocated(self.device)
        for outer in CudaPeak._stack:
            if outer.device == self.device:
                outer.carried = max(outer.carried, current_peak)
        self.start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        CudaPeak._stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            torch.cuda.synchronize(self.device)
            peak = max(self.carried, torch.cuda.max_memory_allocated(self.device))
            self.peak_bytes = max(0, peak - self.start)
        finally:
            CudaPeak._stack.remove(self)


def compilation_count() -> int:
    """Compilation events so far in this process (Dynamo frames, AOTAutograd and Inductor graphs)."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was ever compiled
    if utils is None:
        return 0
    return sum(sum(utils.counters.get(kind, {}).values()) for kind in ("frames", "aot_autograd", "inductor"))


def compiled_code_may_run() -> bool:
    """Whether this process has compiled anything with Dynamo, AOTAutograd or Inductor."""
    return compilation_count() > 0


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 while a profiler session starts or stops.

    libkineto writes a ``profiler_start`` / ``profiler_stop`` log line there on every session,
    which would end up in every measurement's output. Python warnings raised meanwhile are
    re-issued afterwards.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    caught: list[warnings.WarningMessage] = []
    try:
        os.dup2(devnull, 2)
        with warnings.catch_warnings(record=True) as caught:  # the active filters still apply
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


# One profiler session per process: two threads starting sessions at once crash in libkineto.
_SESSION = threading.Lock()


def _profiler_running() -> bool:
    from torch.autograd import profiler as autograd_profiler

    return bool(getattr(autograd_profiler, "_is_profiler_enabled", False)) or torch._C._autograd._profiler_enabled()


class CpuAllocatorTrace:
    """Allocations and frees on ``device`` during the context, as the profiler recorded them.

    After exit (when :attr:`available`): ``peak_bytes`` (highest running sum of allocations
    minus frees, from 0 at entry), ``final_bytes`` (the sum at exit), ``allocated_bytes`` (all
    allocations), ``allocated_ptrs`` (their addresses), ``compiled_regions`` (executions of
    ``torch.compile``'d regions) and ``autograd_nodes`` (backward nodes the engine ran). Frees of blocks allocated before the profiler started are not
    reported by the allocator, so storages that predate the region are never credited.
    ``why_unavailable`` says why nothing was recorded.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.available = False
        self.why_unavailable: str | None = None
        self.peak_bytes = 0
        self.final_bytes = 0
        self.allocated_bytes = 0
        self.allocated_ptrs: frozenset[int] = frozenset()
        self.compiled_regions = 0
        self.autograd_nodes = 0
        self._profile: Any = None

    def __enter__(self) -> CpuAllocatorTrace:
        if not _SESSION.acquire(blocking=False):
            self.why_unavailable = "another thread is tracing the allocator"
            return self
        try:
            self._start()
        finally:
            if self._profile is None:
                _SESSION.release()
        return self

    def _start(self) -> None:
        if _profiler_running():
            self.why_unavailable = "another torch.profiler session is running"
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        prof = profile(activities=activities, profile_memory=True)
        try:
            with _quiet_stderr():
                prof.__enter__()
        except RuntimeError as exc:  # e.g. a profiler session torch does not report as running
            self.why_unavailable = f"torch.profiler did not start: {exc}"
            return
        self._profile = prof
        self.available = True

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._profile is None:
            return
        prof, self._profile = self._profile, None
        try:
            with _quiet_stderr():
                prof.__exit__(exc_type, exc, tb)
        finally:
            _SESSION.release()
        if exc_type is None:
            self._read(prof.profiler.kineto_results)

    def _read(self, results: Any) -> None:
        allocation = torch._C._profiler._EventType.Allocation
        events: list[tuple[int, int, int, int]] = []  # (time, order, bytes, ptr)
        regions = functions = nodes = 0
        stack = list(results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == allocation:
                fields = node.extra_fields
                if self._same_device(fields.device):
                    events.append((node.start_time_ns, len(events), fields.alloc_size, fields.ptr))
            elif node.name.startswith("Torch-Compiled Region"):
                regions += 1
            elif node.name == "CompiledFunction":
                functions += 1
            elif node.name.startswith("autograd::engine::evaluate_function"):
                nodes += 1
        events.sort()
        live = peak = allocated = 0
        ptrs = set()
        for _, _, nbytes, ptr in events:
            live += nbytes
            peak = max(peak, live)
            if nbytes > 0:
                allocated += nbytes
                ptrs.add(ptr)
        self.peak_bytes, self.final_bytes, self.allocated_bytes = peak, live, allocated
        self.allocated_ptrs = frozenset(ptrs)
        self.compiled_regions = max(regions, functions)  # AOTAutograd without Dynamo has no region
        self.autograd_nodes = nodes

    def _same_device(self, device: torch.device) -> bool:
        if device.type != self.device.type:
            return False
        return self.device.index is None or device.index == self.device.index
