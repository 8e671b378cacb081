"""FLOPs of a step with ``torch.utils.flop_counter.FlopCounterMode``, split into forward and backward.

:class:`StepFlopCounter` *is* a ``FlopCounterMode``: torch's dispatch, decompositions and formula
registry decide what counts (matmuls, convolutions, attention; pointwise ops are free). It adds:

- a forward/backward split: FLOPs of ops run by the autograd engine (including recomputation,
  e.g. activation checkpointing, which happens during backward) are ``backward_flops``;
- compiled code stays compiled: its dispatch mode declares ``ignore_compile_internals``, so
  ``torch.compile``'d regions run their compiled code, and the counter sees the ops that code
  dispatches (extern matmul kernels such as ``aten.mm.out``, convolutions, attention, custom ops
  -- what holds the FLOPs). Arithmetic Inductor generates inline (pointwise, and matmuls it
  decomposes for degenerate shapes) is not seen, as pointwise ops are free anyway;
- the formulas torch's registry lacks are registered there by :mod:`gradshard.ops` (each
  custom op beside its definition; :mod:`gradshard.ops.aten_flops` for the fused CPU
  attention kernels), so a plain ``FlopCounterMode`` counts exactly what this one does.

No per-module breakdown (``FlopCounterMode``'s module tracker hooks every module call; only
the ``"Global"`` counts are kept).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

import gradshard.ops  # noqa: F401  (registers the custom ops' FLOP formulas)

from .tracker import graph_task_id

__all__ = ["StepFlopCounter"]


class _CompiledRuntimeMode(_FlopCounterMode):
    """``FlopCounterMode``'s dispatch mode, letting compiled code run compiled (see module doc)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def _op_name(key: Any) -> str:
    if isinstance(key, torch._ops.OpOverloadPacket):
        return str(key)  # "aten.mm"
    return getattr(key, "__name__", None) or str(key)  # higher-order ops, Triton kernels


class StepFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` with a forward/backward split that leaves compiled code compiled.

    Usage::

        with StepFlopCounter() as fc:
            model(x).sum().backward()
        fc.get_total_flops(), fc.backward_flops, fc.flops_by_op()
    """

    def __init__(self) -> None:
        super().__init__(display=False)
        self.backward_flops = 0
        """FLOPs of ops run by the autograd engine."""
        self.flop_registry = {key: self._split(formula) for key, formula in self.flop_registry.items()}

    def _split(self, formula: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> int:
            flops = formula(*args, **kwargs)
            if graph_task_id() != -1:
                self.backward_flops += flops
            return flops

        return counted

    def __enter__(self) -> StepFlopCounter:
        self.flop_counts.clear()
        self.backward_flops = 0
        self.mode = _CompiledRuntimeMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        mode, self.mode = self.mode, None  # break the counter <-> mode cycle
        return mode.__exit__(*exc)

    @property
    def forward_flops(self) -> int:
        """FLOPs of ops run outside the autograd engine."""
        return self.get_total_flops() - self.backward_flops

    def flops_by_op(self) -> dict[str, int]:
        """``{op name: FLOPs}`` of the ops that counted any (``"aten.mm"``, ``"gradshard.linear_scan"``)."""
        return {_op_name(k): int(n) for k, n in self.flop_counts.get("Global", {}).items() if n}
