"""Stack traces of traced nodes: recorded from the frames above the capture, shared when equal.

fx records a stack trace on every node it creates (``record_stack_traces``): it symbolises the
whole Python stack (``CapturedTraceback.extract().summary()``, a source line read per frame) and
then keeps the frames of ``forward`` methods. Under a training loop, a test runner or a notebook
that stack is ~100 frames deep, and a capture creates thousands of nodes: symbolising frames that
are then thrown away was ~5% of a compile. :func:`frames_above` swaps fx's traceback for one that
walks only the frames above the capture's own entry frame, and reads a source line only where fx
formats a kept frame. What fx keeps is unchanged, except that frames *below* the capture (the
caller's own ``forward``, e.g. a wrapper module calling ``gs.compile``'d code) no longer appear in
the graph's stack traces: they are not the model's code.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import types
from typing import Iterator

import torch.fx as fx
import torch.fx.proxy as fx_proxy

__all__ = ["frames_above", "share_stack_traces"]


class _FramesAbove:
    """Stands in for :class:`torch.utils._traceback.CapturedTraceback` in ``torch.fx.proxy``."""

    def __init__(self, entry: types.CodeType, original: type) -> None:
        self.entry = entry
        self.original = original

    def extract(self, *args, **kwargs) -> "_Summary | object":
        frames: list[traceback.FrameSummary] = []
        f = sys._getframe(1)
        while f is not None and f.f_code is not self.entry:
            code = f.f_code
            frames.append(traceback.FrameSummary(code.co_filename, f.f_lineno, code.co_name, lookup_line=False))
            f = f.f_back
        if f is None:  # not under the capture (another thread tracing): fx's own traceback
            return self.original.extract(*args, **kwargs)
        frames.reverse()
        return _Summary(frames)


class _Summary:
    """What fx reads of a traceback: its summary, outermost frame first (lines read when formatted)."""

    def __init__(self, frames: list[traceback.FrameSummary]) -> None:
        self.frames = frames

    def summary(self) -> traceback.StackSummary:
        return traceback.StackSummary.from_list(self.frames)


@contextlib.contextmanager
def frames_above(entry: types.CodeType) -> Iterator[None]:
    """While active, fx records node stack traces from the frames above the innermost frame
    running ``entry`` (the capture's entry function). Hold the trace lock: fx's module is patched."""
    original = fx_proxy.CapturedTraceback
    fx_proxy.CapturedTraceback = _FramesAbove(entry, original)
    try:
        yield
    finally:
        fx_proxy.CapturedTraceback = original


def share_stack_traces(gm: fx.GraphModule) -> None:
    """Make nodes with equal stack traces share one string.

    make_fx formats a stack trace per node; an unrolled loop's steps (and a model's repeated
    layers) repeat the same few, so a kept graph would otherwise hold one copy per node."""
    seen: dict[str, str] = {}
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace is not None:
            node.meta["stack_trace"] = seen.setdefault(trace, trace)
