"""Fake values for nodes a pass or capture creates: ``meta['val']`` without real data."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

__all__ = ["fake_run", "private_dispatch_cache"]

_private = threading.local()  # depth of nested private_dispatch_cache blocks in this thread


@contextlib.contextmanager
def private_dispatch_cache() -> Iterator[None]:
    """Drop, at exit, the fake-tensor dispatch cache entries made inside the block.

    ``FakeTensorMode.cache`` is one process-wide dict that keeps an entry (with its output
    fake tensor) for every op signature ever dispatched. A compile dispatches thousands of
    signatures once -- a capture unrolls a loop's steps, a probe has its own lengths -- and
    none is needed after it: in the global cache they would stay resident for the life of
    the process (3.5 MiB after one compile of a small Mamba). Inside the block the cache
    still serves repeats; entries that were there before are kept. Another thread's entries
    made meanwhile may go too: it is a cache, they are recomputed when next needed.

    Re-entrant: a block inside another (a fake propagation inside a compile) leaves the
    dropping to the outermost, so the compile's propagations share their entries (a third
    of the fake-dispatch time of an adjoint compile, which re-specialises each region graph
    to several shard lengths)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if getattr(_private, "depth", 0):
        _private.depth += 1
        try:
            yield
        finally:
            _private.depth -= 1
        return
    cache = FakeTensorMode.cache
    before = set(list(cache))  # list() copies the keys atomically; hashing them may switch threads
    _private.depth = 1
    try:
        yield
    finally:
        _private.depth = 0
        for key in list(cache):
            if key not in before:
                cache.pop(key, None)


def fake_run(fn: Callable[..., Any], args: tuple, kwargs: dict | None = None) -> Any:
    """Run ``fn`` on fresh fake tensors shaped like the ``meta['val']`` of the nodes in ``args``.

    (Captured graphs may hold values from several fake modes; one new mode is used here.)
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    kwargs = kwargs or {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def val_of(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return _refake(v, mode)
        return a

    with mode:
        fargs = fx.node.map_aggregate(args, val_of)
        fkwargs = fx.node.map_aggregate(kwargs, val_of)
        return fn(*fargs, **fkwargs)


def _refake(v: Any, mode: Any) -> Any:
    if isinstance(v, torch.Tensor):
        with mode:
            t = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)
        return t.requires_grad_(v.requires_grad) if v.dtype.is_floating_point else t
    if isinstance(v, (list, tuple)):
        return type(v)(_refake(x, mode) for x in v)
    return v
