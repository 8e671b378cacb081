"""Fake values for nodes a pass or capture creates: ``meta['val']`` without real data."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

__all__ = ["fake_run"]


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
