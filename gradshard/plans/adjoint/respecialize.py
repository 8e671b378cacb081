"""The adjoint runtime's length helpers; re-specialisation itself is shared by plans.

:mod:`gradshard.passes.respecialize` rewrites a graph's length-dependent integers and verifies
the result by fake-tensor shape propagation (the chunked plans use it too); its names are
re-exported here for the adjoint modules that import them from this path.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from gradshard.passes.respecialize import (DimFact, Facts, RespecializeError, expected_shape, fake_propagate,
                                           respecialize, time_facts)

__all__ = ["DimFact", "Facts", "RespecializeError", "time_facts", "respecialize", "expected_shape", "fake_propagate",
           "time_length", "wanted_grads", "grad_leaves", "add_input_grad", "shard_bounds"]


def time_length(inputs: Sequence[Any], time_dims: Sequence[Optional[int]], who: str) -> int:
    """Length of the time axis of the first input that carries one (``who`` names the caller)."""
    for x, d in zip(inputs, time_dims):
        if d is not None:
            return int(x.shape[d])
    raise RuntimeError(f"{who} carries the time axis")


def wanted_grads(leaves: Sequence[Any], needs: Sequence[bool]) -> list[int]:
    """The positions of ``leaves`` a shard's VJP returns a gradient for: floating tensors that need one."""
    return [i for i, x in enumerate(leaves) if needs[i] and isinstance(x, torch.Tensor) and x.dtype.is_floating_point]


def grad_leaves(leaves: Sequence[Any], needs: Sequence[bool]) -> list[Any]:
    """``leaves`` with those in :func:`wanted_grads` detached and requiring grad (a shard's VJP inputs)."""
    wanted = set(wanted_grads(leaves, needs))
    return [x.detach().requires_grad_(True) if i in wanted else x for i, x in enumerate(leaves)]


def add_input_grad(grads: list[Optional[torch.Tensor]], i: int, g: torch.Tensor, time_dim: Optional[int],
                   start: int, stop: int, zeros: Callable[[], torch.Tensor]) -> None:
    """Accumulate a shard's gradient ``g`` of input ``i`` into ``grads[i]``: whole when the input has
    no time dim, else into ``[start, stop)`` along ``time_dim`` of a full-length buffer (``zeros()``).

    Both accumulate in place into a buffer of our own: ``acc + g`` would hold the old sum, the
    shard's ``g`` and the new sum at once (a third parameter-sized buffer at every shard), and a
    shard's ``g`` itself may alias what its backward returned, so it is never written into."""
    if grads[i] is None:
        grads[i] = zeros()
    if time_dim is None:
        grads[i].add_(g)
    else:
        grads[i].narrow(time_dim, start, stop - start).add_(g)


def shard_bounds(T: int, shard_size: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``[0, T)`` in shards of ``shard_size`` (one empty shard for T=0)."""
    S = max(1, shard_size)
    return [(s, min(s + S, T)) for s in range(0, T, S)] or [(0, 0)]
