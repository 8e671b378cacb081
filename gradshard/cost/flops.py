"""FLOP formulas ``torch.utils.flop_counter`` lacks, registered so every counter sees them.

PyTorch counts ``F.scaled_dot_product_attention`` on CUDA (flash, efficient, cuDNN kernels)
but not the CPU flash kernel it dispatches to on CPU, so a CPU measurement of an attention
model silently drops the attention FLOPs. :func:`register_missing_flop_formulas` adds the
CPU kernel with the same formula PyTorch uses for the CUDA ones (``4·B·H·Tq·Tk·d`` forward,
2.5x that backward; like PyTorch, causal masking is not discounted), so the cost model,
``gs.measure`` and a GPU run count the same attention FLOPs. It is idempotent and runs when
:mod:`gradshard.cost` is imported; ``FlopCounterMode`` copies the registry when constructed,
so counters created before that import do not see the additions.
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter as fc

__all__ = ["register_missing_flop_formulas", "MISSING_FLOP_FORMULAS"]

aten = torch.ops.aten


def _sdpa_cpu_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return fc.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


MISSING_FLOP_FORMULAS = {
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa_cpu_forward,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_cpu_backward,
}


def register_missing_flop_formulas() -> list[str]:
    """Register the formulas above for the ops this torch build has; return the names added."""
    added = []
    for name, formula in MISSING_FLOP_FORMULAS.items():
        packet = getattr(aten, name, None)
        if packet is None or packet in fc.flop_registry:
            continue
        fc.register_flop_formula(packet)(formula)
        added.append(name)
    return added
