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
- formulas torch's registry lacks, registered there by :func:`register_flop_formulas`:
  gradshard's custom ops (:mod:`gradshard.op_flops`) and the fused CPU attention kernels.

No per-module breakdown (``FlopCounterMode``'s module tracker hooks every module call; only
the ``"Global"`` counts are kept).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    _FlopCounterMode,
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from gradshard.op_flops import register_op_flop_formulas

from .tracker import graph_task_id

__all__ = ["StepFlopCounter", "register_flop_formulas"]

_aten = torch.ops.aten
_REGISTER_LOCK = threading.Lock()


def _cpu_flash_attention_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_attention_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# The fused CPU attention kernels, counted with torch's formulas for the GPU ones (two matmuls
# forward; backward five, as flash kernels recompute the scores).
_ATEN_EXTRAS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward_flop,
}


def register_flop_formulas() -> None:
    """Register every formula gradshard adds to ``torch.utils.flop_counter`` (idempotent).

    After this, a plain ``FlopCounterMode`` counts exactly what :class:`StepFlopCounter` does.
    """
    with _REGISTER_LOCK:
        for packet, formula in _ATEN_EXTRAS.items():
            if packet not in flop_registry:
                register_flop_formula(packet)(formula)
        register_op_flop_formulas()


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
        register_flop_formulas()
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
