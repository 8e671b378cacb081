"""gs.measure on torch.compile'd code: it measures the compiled step, not an eager stand-in.

Checked with facts that do not depend on timing: the compiled region runs in the instrumented
call (the profiler sees it, Dynamo compiles nothing new), Inductor's fusion shows up as a lower
peak than eager, FLOPs of the extern matmul kernels it calls are counted, and the peaks agree
with what the operating system saw (RSS) and with the CPU allocator's own count.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from gradshard.measure import (CpuAllocatorTrace, LiveTensorTracker, PeakRss, SavedTensorRecorder, measure,
                               record_saved, step)

N = 10 * 2**20  # 40 MiB per float32 tensor: above glibc's largest mmap threshold (32 MiB), so
# every tensor is its own mapping and RSS rises and falls with the allocator.
MiB = 2**20
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="RSS peaks are read from /proc/self")


def _sigmoid_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x
    for _ in range(4):
        h = torch.sigmoid(h * w)
    return h.sum()


@functools.cache
def _compiled_chain():
    """One Inductor compilation of the chain, shared by the tests (compiling takes seconds)."""
    return torch.compile(_sigmoid_chain)



def _rss_of_step(fn, *args) -> int:
    with PeakRss() as rss:
        step(fn)(*args)
    assert rss.peak_bytes is not None, "/proc/self/clear_refs or VmHWM unavailable"
    return rss.peak_bytes


@linux_only
def test_inductor_step_is_measured_compiled_and_agrees_with_rss() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(N), torch.randn(N, requires_grad=True)
    compiled = _compiled_chain()
    compiled(x, w).backward()  # compile outside the measurements
    expected_grad, w.grad = w.grad, None

    eager = measure(step(_sigmoid_chain), x, w, repeat=0)
    eager_rss = _rss_of_step(_sigmoid_chain, x, w)
    w.grad = None
    # (a guard another test left behind may recompile the chain once: warmup=1 absorbs it)
    m = measure(step(compiled), x, w, warmup=1, repeat=1)
    torch.testing.assert_close(w.grad, 3 * expected_grad)  # warmup, instrumented and timed calls
    w.grad = None
    compiled_rss = _rss_of_step(compiled, x, w)

    # Eager: the tracker's peak; sigmoid saves its output, so 4 activations + 2 temporaries live.
    assert eager.peak_source == "tracker" and eager.peak_bytes == pytest.approx(6 * 4 * N, abs=64)
    assert eager.saved_bytes == 4 * 4 * N
    # Compiled: the compiled region ran in the instrumented call and the peak is the allocator's.
    assert m.compiled_regions == 1 and m.peak_source == "cpu_allocator"
    assert m.allocator_peak_bytes == m.peak_bytes
    # Inductor fused the chain and recomputes it in backward instead of saving 4 activations:
    # the step keeps at most two 40 MiB buffers alive (eager: six), and saves none of them.
    assert m.peak_bytes <= 2 * 4 * N < eager.peak_bytes
    assert m.saved_bytes < eager.saved_bytes
    # The tracker alone would miss Inductor's buffers: that is why the allocator is used.
    assert m.tracked_peak_bytes < m.peak_bytes
    # Both peaks agree with the operating system's view within 5%.
    assert eager.peak_bytes == pytest.approx(eager_rss, rel=0.05)
    assert m.peak_bytes == pytest.approx(compiled_rss, rel=0.05)


def test_eager_peak_agrees_with_the_cpu_allocator() -> None:
    """The tracker (dispatch-level) and the c10 CPU allocator count the same activation bytes."""
    x, w = torch.randn(N // 16), torch.randn(N // 16, requires_grad=True)
    m = measure(step(_sigmoid_chain), x, w, repeat=0)
    w.grad = None
    with CpuAllocatorTrace() as trace:
        step(_sigmoid_chain)(x, w)
    assert trace.available and trace.compiled_regions == 0
    assert m.peak_bytes == pytest.approx(trace.peak_bytes, rel=0.05)
    assert m.retained_bytes == trace.final_bytes == 4 * (N // 16)  # w.grad


def test_flops_inside_compiled_code_are_counted() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 8))
    x = torch.randn(16, 24)
    compiled = torch.compile(model)
    loss = step(lambda x: compiled(x).square().sum())
    eager = measure(step(lambda x: model(x).square().sum()), x, repeat=0)
    m = measure(loss, x, warmup=1, repeat=0)
    assert m.compiled_regions == 1
    # The matmuls run as extern kernels (aten.addmm.out / aten.mm.out) that the counter sees.
    assert (m.forward_flops, m.backward_flops) == (eager.forward_flops, eager.backward_flops)
    assert m.flops == 2 * 16 * (24 * 40 + 40 * 8) * 3 - 2 * 16 * 24 * 40  # no input gradient
    assert any("compiled regions" in note for note in m.notes)


def test_profiler_already_running_is_reported_not_hidden() -> None:
    """Without the allocator trace (a profiler of the user's holds the session) the measurement
    says so, and falls back to the tracker's peak, which misses Inductor's buffers."""
    x, w = torch.randn(N), torch.randn(N, requires_grad=True)
    compiled = _compiled_chain()
    compiled(x, w).backward()
    w.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        m = measure(step(compiled), x, w, repeat=0)
    assert m.compiled_regions is None and m.allocator_peak_bytes is None
    assert m.peak_source == "tracker" and m.peak_bytes < 4 * N  # not even w.grad's 40 MiB
    assert any("could not be traced" in note for note in m.notes)
    assert w.grad is not None


def test_saved_recorder_sees_a_backward_by_its_unpacks() -> None:
    """A compiled backward may dispatch no op the tracker sees; it still unpacks what its forward
    saved, which is how ``measure`` knows a backward ran."""
    x = torch.randn(7, requires_grad=True)
    tracker = LiveTensorTracker()
    forward_only, both = SavedTensorRecorder(tracker), SavedTensorRecorder(tracker)
    with tracker, record_saved(both):
        with record_saved(forward_only):  # nested: the inner hooks serve both recorders
            y = x.exp().sum()
        assert forward_only.unpacked == both.unpacked == 0 and forward_only.activation_bytes == 28
        y.backward()  # ExpBackward unpacks its saved output
    assert forward_only.unpacked == both.unpacked == 1


def test_saved_recorder_ignores_a_trace_inside_the_step() -> None:
    """A plan may capture its graph inside the measured step (its first call): the fake tensors
    autograd saves while the trace runs are not memory and have no address to settle, and the
    fake activations it makes are not live bytes."""
    from gradshard.capture.trace import capture

    lin = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Sigmoid())
    long = torch.randn(4096, 5)
    tracker = LiveTensorTracker(count_fake=False)  # as gs.measure
    recorder = SavedTensorRecorder(tracker, settle_by_address=True)  # as under compiled code
    with tracker, record_saved(recorder):
        capture(lin, (long,))
        y = lin(torch.randn(3, 5)).exp().sum()
    assert recorder.total_bytes > 0 and recorder.settle(set()) == 0
    assert 0 < tracker.peak_bytes < long.nbytes
    y.backward()
