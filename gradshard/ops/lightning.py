"""``gradshard::lightning_attention``: causal linear attention with decay as one custom op, with its rules.

``q, k``: (B, H, T, dk); ``v``: (B, H, T, dv); ``decay``: None, (H,) constant per head, or
(B, H, T) per-step gates; ``initial_state``: (B, H, dk, dv) or None::

    kv_t = decay_t * kv_{t-1} + k_t^T v_t,   o_t = q_t kv_t,   kv_0 = initial_state (or 0)

Returns ``(o, final_state)``: ``o`` (B, H, T, dv) in the promoted input dtype and ``kv_T``
(B, H, dk, dv) in the accumulation dtype (float32 for half inputs, float64 for float64), the
state a LASP rank sends to the next one. Gradients flow to q, k, v, decay (either form),
initial_state, and from ``final_state`` when it is used downstream (LASP backward receives
dS from the next rank and returns d(initial_state)). The algorithm never divides by nor takes
logs of decays, so gates near 0 (or exactly 0) are handled exactly; the documented range is (0, 1].
``chunk_size`` sets the block length (results do not depend on it beyond rounding).

Tracing records one ``torch.ops.gradshard.lightning_attention.default`` node (its backward is
``torch.ops.gradshard.lightning_attention_backward``, itself not differentiable again).

Registered with the op: fakes, the VJP (the backward op), and the time rule (reads all of
the past along dim 2). Kernels: :mod:`gradshard.kernels.lightning`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from gradshard.analysis import locality
from gradshard.kernels.lightning import lightning_dtypes, run_lightning_backward, run_lightning_forward
from gradshard.kernels.ssd_torch import ssd_chunk_scan

__all__ = ["LIGHTNING", "lightning_attention_flops", "lightning_attention_backward_flops", "block_scan",
           "decay_per_head"]

LIGHTNING = "gradshard::lightning_attention"


@torch.library.custom_op(LIGHTNING, mutates_args=())
def _lightning_op(q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor], initial_state: Optional[Tensor],
                  chunk_size: int, backend: Optional[str]) -> tuple[Tensor, Tensor]:
    """Dispatcher-level op; see the module docstring."""
    return run_lightning_forward(q, k, v, decay, initial_state, chunk_size, backend)


@_lightning_op.register_fake
def _lightning_fake(q, k, v, decay, initial_state, chunk_size, backend):
    out_dtype, acc = lightning_dtypes(q, k, v)
    b, h, length, dk = q.shape
    return q.new_empty((b, h, length, v.shape[-1]), dtype=out_dtype), q.new_empty((b, h, dk, v.shape[-1]), dtype=acc)


@torch.library.custom_op("gradshard::lightning_attention_backward", mutates_args=())
def _lightning_bwd_op(q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor], initial_state: Optional[Tensor],
                      grad_o: Tensor, grad_state: Optional[Tensor], chunk_size: int,
                      backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, d_decay (decay's shape; empty when decay is None), d_initial_state)."""
    return run_lightning_backward(q, k, v, decay, initial_state, grad_o, grad_state, chunk_size, backend)


@_lightning_bwd_op.register_fake
def _lightning_bwd_fake(q, k, v, decay, initial_state, grad_o, grad_state, chunk_size, backend):
    _, acc = lightning_dtypes(q, k, v)
    d_decay = q.new_empty((0,)) if decay is None else decay.new_empty(decay.shape)
    s_dtype = initial_state.dtype if initial_state is not None else acc
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_decay,
            q.new_empty((*q.shape[:2], q.shape[-1], v.shape[-1]), dtype=s_dtype))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, decay, initial_state, chunk_size, backend = inputs
    ctx.chunk_size, ctx.backend = chunk_size, backend
    ctx.save_for_backward(q, k, v, decay, initial_state)


def _backward(ctx, grad_o: Optional[Tensor], grad_state: Optional[Tensor]):
    q, k, v, decay, initial_state = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=v.dtype, device=q.device)
    dq, dk, dv, dd, ds0 = torch.ops.gradshard.lightning_attention_backward(
        q, k, v, decay, initial_state, grad_o, grad_state, ctx.chunk_size, ctx.backend
    )
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
            dd if decay is not None and need[3] else None,
            ds0 if initial_state is not None and need[4] else None, None, None)


_lightning_op.register_autograd(_backward, setup_context=_setup_context)

locality.register_time_op(LIGHTNING, time_dim=2, reach=locality.ALL_PAST)


# --------------------------------------------------------------------------- the block form of an outer-product scan


def decay_per_head(t: Tensor, like: Tensor, state_dims: int = 0) -> Tensor:
    """A decay ``t`` (or log-decay) as :func:`block_scan` takes it, ``(batch, steps, heads)`` like
    ``like``'s leading dims: its last ``state_dims`` dims (size 1: constant over the state) dropped,
    missing leading dims (a decay without batch or time axis) broadcast."""
    if state_dims:
        t = t.reshape(t.shape[:-state_dims])
    return t.reshape((1,) * (3 - t.dim()) + tuple(t.shape)).expand(like.shape[:3])


def block_scan(decay: Optional[Tensor], log_decay: bool, values: Tensor, keys: Tensor, query: Tensor,
               state: Optional[Tensor], contracted: int, chunk: int,
               backend: Optional[str] = None, query2: Optional[Tensor] = None) -> tuple[Tensor, ...]:
    """``(y, h_end)`` of ``h_t = a_t h_{t-1} + outer(v_t, k_t)``, ``y_t = h_t q_t`` in block form.

    ``values`` (b, n, H, dv), ``keys`` and ``query`` (b, n, H, dk); ``decay`` per (b, n, H): the
    log-decay ``z`` (``log_decay``: SSD's block form, :func:`gradshard.kernels.ssd_torch.ssd_chunk_scan`)
    or ``a`` itself (this op; None: no decay). ``state`` and ``h_end`` are in the scan's layout:
    ``(b, H, dv, dk)`` when ``contracted`` is -1 (SSD's ``h (P, N)``), ``(b, H, dk, dv)`` when -2.
    ``query2`` (like ``query``): a second readout ``y2_t = h_t query2_t``, returned third (SSD's
    form shares its block states; the op runs twice)."""
    flip = lambda h: None if h is None else h.transpose(-1, -2)  # noqa: E731
    if log_decay:  # SSD's function keeps (values, keys)
        y, h_end, *y2 = ssd_chunk_scan(decay, values, keys, query, state if contracted == -1 else flip(state), chunk,
                                       query2)
        return (y, h_end if contracted == -1 else flip(h_end), *y2)
    heads_first = lambda t: t.transpose(1, 2)  # noqa: E731 - (b, n, H, d) -> (b, H, n, d); the op keeps (keys, values)
    d = None if decay is None else heads_first(decay).contiguous()
    s0 = flip(state) if contracted == -1 else state
    y, h_end = _lightning_op(heads_first(query), heads_first(keys), heads_first(values), d, s0, chunk, backend)
    out = (heads_first(y), flip(h_end) if contracted == -1 else h_end)
    if query2 is None:
        return out
    y2, _ = _lightning_op(heads_first(query2), heads_first(keys), heads_first(values), d, s0, chunk, backend)
    return (*out, heads_first(y2))


# --------------------------------------------------------------------------- FLOPs (FlopCounterMode)

Shape = Sequence[Any]


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


def _lightning_formula(q: Shape, k: Shape, v: Shape, decay: Optional[Shape] = None,
                       initial_state: Optional[Shape] = None, chunk_size: int = 64,
                       backend: Optional[str] = None, *, out_shape: Any = None, **_: Any) -> int:
    return lightning_attention_flops(q, v, chunk_size)


def _lightning_backward_formula(q: Shape, k: Shape, v: Shape, decay: Optional[Shape] = None,
                                initial_state: Optional[Shape] = None, grad_o: Optional[Shape] = None,
                                grad_state: Optional[Shape] = None, chunk_size: int = 64,
                                backend: Optional[str] = None, *, out_shape: Any = None, **_: Any) -> int:
    return lightning_attention_backward_flops(q, v, chunk_size, decay is not None)


register_flop_formula(torch.ops.gradshard.lightning_attention)(_lightning_formula)
register_flop_formula(torch.ops.gradshard.lightning_attention_backward)(_lightning_backward_formula)
