"""FLOP formulas torch's ``flop_counter`` lacks for aten ops gradshard's plans run.

The fused CPU attention kernels are counted with torch's formulas for the GPU ones: two
matmuls forward, five backward (the scores are recomputed). Registered at import; an op that
already has a formula keeps it.

Grouped-query attention (key/value with fewer heads than the query): torch before 2.13 asserts
in its SDPA formulas when the head counts differ, which would make any ``FlopCounterMode``
around a GQA model fail (gradshard counts FLOPs in its chunk dry run). Where the installed
formulas reject GQA, the SDPA-family formulas are wrapped to count key/value broadcast to the
query's heads, which is what the kernels compute and what torch 2.13's formulas count.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

Shape = Sequence[Any]


def _cpu_flash_attention_formula(query: Shape, key: Shape, value: Shape, *args: Any, out_shape: Any = None,
                                 **kwargs: Any) -> int:
    return sdpa_flop_count(query, *_broadcast_heads(query, key, value))


def _cpu_flash_attention_backward_formula(grad_out: Shape, query: Shape, key: Shape, value: Shape, *args: Any,
                                          out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, *_broadcast_heads(query, key, value))


def _broadcast_heads(query: Shape, *kv: Shape) -> list[Shape]:
    """``kv`` shapes ``(B, Hkv, S, D)`` with the heads of ``query`` ``(B, H, S', D')`` when ``Hkv`` divides ``H``."""
    if len(query) != 4 or any(len(s) != 4 for s in kv):
        return list(kv)
    h = query[1]
    return [torch.Size((s[0], h, s[2], s[3])) if s[1] != h and h % s[1] == 0 else s for s in kv]


def _counts_gqa() -> bool:
    """Whether torch's own SDPA formula accepts key/value with fewer heads than the query."""
    try:
        sdpa_flop_count((1, 2, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))
    except AssertionError:
        return False
    return True


def count_gqa_broadcast(formula: Callable[..., int], qkv_at: tuple[int, int, int]) -> Callable[..., int]:
    """``formula`` (a registry entry: tensors in, FLOPs out) with the key/value arguments at
    ``qkv_at[1:]`` given as shapes broadcast to the heads of the query at ``qkv_at[0]``."""

    def counted(*args: Any, **kwargs: Any) -> int:
        q = args[qkv_at[0]]
        kv = [args[i] for i in qkv_at[1:]]
        if isinstance(q, torch.Tensor) and all(isinstance(t, torch.Tensor) for t in kv):
            shapes = _broadcast_heads(q.shape, *(t.shape for t in kv))
            args = tuple(shapes[qkv_at.index(i) - 1] if i in qkv_at[1:] else a for i, a in enumerate(args))
        return formula(*args, **kwargs)

    return counted


_aten = torch.ops.aten
for _packet, _formula in {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_formula,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward_formula,
}.items():
    if _packet not in flop_registry:
        register_flop_formula(_packet)(_formula)

#: The SDPA-family ops whose arguments are (query, key, value, ...) / (grad_out, query, key, value, ...)
#: in (B, H, S, D) layout.
_SDPA_QKV = {
    "_scaled_dot_product_efficient_attention": (0, 1, 2),
    "_scaled_dot_product_flash_attention": (0, 1, 2),
    "_scaled_dot_product_cudnn_attention": (0, 1, 2),
    "_scaled_dot_product_efficient_attention_backward": (1, 2, 3),
    "_scaled_dot_product_flash_attention_backward": (1, 2, 3),
    "_scaled_dot_product_cudnn_attention_backward": (1, 2, 3),
}
if not _counts_gqa():
    for _name, _at in _SDPA_QKV.items():
        _op = getattr(_aten, _name, None)
        if _op is not None and _op in flop_registry:
            flop_registry[_op] = count_gqa_broadcast(flop_registry[_op], _at)
