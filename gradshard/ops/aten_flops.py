"""FLOP formulas torch's ``flop_counter`` lacks for aten ops gradshard's plans run.

The fused CPU attention kernels are counted with torch's formulas for the GPU ones: two
matmuls forward, five backward (the scores are recomputed). Registered at import; an op that
already has a formula keeps it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

Shape = Sequence[Any]


def _cpu_flash_attention_formula(query: Shape, key: Shape, value: Shape, *args: Any, out_shape: Any = None,
                                 **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_attention_backward_formula(grad_out: Shape, query: Shape, key: Shape, value: Shape, *args: Any,
                                          out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


_aten = torch.ops.aten
for _packet, _formula in {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_formula,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward_formula,
}.items():
    if _packet not in flop_registry:
        register_flop_formula(_packet)(_formula)
