"""FLOP formulas of gradshard's custom ops, registered with ``torch.utils.flop_counter``.

``register_op_flop_formulas()`` (idempotent) registers one formula per op with
:func:`torch.utils.flop_counter.register_flop_formula`, so ``FlopCounterMode`` -- and therefore
``gs.measure`` and the cost model's probes -- count these ops instead of seeing them as free::

    torch.ops.gradshard.linear_scan                  2 * numel(h)             (one multiply-add per element)
    torch.ops.gradshard.dense_linear_scan            2 * numel(h) * n         (an n x n matrix per step)
    torch.ops.gradshard.adjoint_shard                2 * linear_scan(u)       (recompute h, reverse scan)
    torch.ops.gradshard.lightning_attention          see lightning_attention_flops
    torch.ops.gradshard.lightning_attention_backward see lightning_attention_backward_flops

Convention, as torch's own formulas: a multiply-add is 2 FLOPs; in the attention ops only the
matrix products count (masks, decay factors and the chunk-to-chunk state scan are free). The
scans are counted although they are elementwise, because their arithmetic is the op's work
(torch's ``mul``/``add`` would be free). Anything that needs an op's FLOPs (stage estimates,
the cost model) calls the shape-level functions below rather than writing its own formula.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

__all__ = [
    "adjoint_shard_flops",
    "dense_linear_scan_flops",
    "lightning_attention_backward_flops",
    "lightning_attention_flops",
    "linear_scan_flops",
    "register_op_flop_formulas",
]

Shape = Sequence[Any]  # ints, or SymInts while tracing symbolically


# --------------------------------------------------------------------------- formulas on shapes


def linear_scan_flops(h_shape: Shape) -> int:
    """``h_t = a_t h_{t-1} + u_t``: one multiply and one add per element of ``h`` (``u``'s shape)."""
    return 2 * math.prod(h_shape)


def dense_linear_scan_flops(h_shape: Shape, state_size: int) -> int:
    """``h_t = A_t @ h_{t-1} + u_t`` with ``A_t`` ``n x n``: ``2 n`` per element of ``h``."""
    return 2 * math.prod(h_shape) * state_size


def adjoint_shard_flops(u_shape: Shape) -> int:
    """One shard's gradients: the forward scan recomputing ``h`` and the reverse scan of ``lam``."""
    return 2 * linear_scan_flops(u_shape)


def lightning_attention_flops(q_shape: Shape, v_shape: Shape, chunk_size: int) -> int:
    """Forward of chunked linear attention, per batch and head: every step's query meets a block
    of ``C = chunk_size`` keys, and every block updates the state, i.e. per block of ``C`` steps::

        Q K^T (2 C^2 dk), (.. * M) V (2 C^2 dv), (P * Q) S (2 C dk dv), (Gam * K)^T V (2 C dk dv)

    Linear in the length ``T`` (``T / C`` blocks); exact when ``C`` divides ``T`` (a shorter last
    block is counted as a full one).
    """
    b, h, length, dk = q_shape
    dv = v_shape[-1]
    return b * h * length * (2 * chunk_size * (dk + dv) + 4 * dk * dv)


def lightning_attention_backward_flops(q_shape: Shape, v_shape: Shape, chunk_size: int, has_decay: bool) -> int:
    """Backward of chunked linear attention (``gradshard.kernels.lightning_torch``), per block of ``C``:

    the scores ``Q K^T`` and ``dO V^T`` again and ``dQ``, ``dK``, ``dV`` from them
    (``2 C^2 (3 dk + 2 dv)``), the states recomputed and carried back (five ``2 C dk dv``
    products); with a decay, its gradient adds two ``2 C dk dv`` products, a ``C x C``
    matrix-vector and a ``C x C x C`` product. Linear in ``T``, as the forward.
    """
    b, h, length, dk = q_shape
    dv = v_shape[-1]
    c = chunk_size
    per_step = 2 * c * (3 * dk + 2 * dv) + 10 * dk * dv
    if has_decay:
        per_step += 4 * dk * dv + 2 * c + 2 * c * c
    return b * h * length * per_step


# --------------------------------------------------------------------------- registry adapters
# ``register_flop_formula`` wraps these with ``shape_wrapper``: tensors arrive as their shapes,
# the output's as ``out_shape``; argument names follow the ops' schemas.


def _linear_scan_formula(a: Shape, u: Shape, h0: Optional[Shape] = None, reverse: bool = False,
                         backend: Optional[str] = None, *, out_shape: Any = None, **_: Any) -> int:
    return linear_scan_flops(out_shape if out_shape is not None else u)


def _dense_scan_formula(A: Shape, u: Shape, h0: Optional[Shape] = None, *, out_shape: Any = None, **_: Any) -> int:
    return dense_linear_scan_flops(out_shape if out_shape is not None else u, A[-1])


def _adjoint_shard_formula(a: Shape, u: Shape, g: Shape, h0: Optional[Shape] = None,
                           lam_carry: Optional[Shape] = None, backend: Optional[str] = None, *,
                           out_shape: Any = None, **_: Any) -> int:
    return adjoint_shard_flops(u)


def _lightning_formula(q: Shape, k: Shape, v: Shape, decay: Optional[Shape] = None,
                       initial_state: Optional[Shape] = None, chunk_size: int = 64,
                       backend: Optional[str] = None, *, out_shape: Any = None, **_: Any) -> int:
    return lightning_attention_flops(q, v, chunk_size)


def _lightning_backward_formula(q: Shape, k: Shape, v: Shape, decay: Optional[Shape] = None,
                                initial_state: Optional[Shape] = None, grad_o: Optional[Shape] = None,
                                grad_state: Optional[Shape] = None, chunk_size: int = 64,
                                backend: Optional[str] = None, *, out_shape: Any = None, **_: Any) -> int:
    return lightning_attention_backward_flops(q, v, chunk_size, decay is not None)


_FORMULAS = {
    "linear_scan": _linear_scan_formula,
    "dense_linear_scan": _dense_scan_formula,
    "adjoint_shard": _adjoint_shard_formula,
    "lightning_attention": _lightning_formula,
    "lightning_attention_backward": _lightning_backward_formula,
}


def register_op_flop_formulas() -> None:
    """Register the formulas above in ``torch.utils.flop_counter``'s registry (idempotent).

    An op that already has a formula (registered by an earlier call, or by its own module once
    the formulas move beside the ops) keeps it.
    """
    import torch
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    import gradshard.ops  # noqa: F401 - defines torch.ops.gradshard.*

    for name, formula in _FORMULAS.items():
        packet = getattr(torch.ops.gradshard, name)
        if packet not in flop_registry:
            register_flop_formula(packet)(formula)
