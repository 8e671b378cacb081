"""``lightning_attention``: block-wise causal linear attention with decay, front door and dispatch.

The ops (``gradshard::lightning_attention`` and its backward: fakes, VJP, time rule) are
defined in :mod:`gradshard.ops.lightning`; this module validates arguments and runs the torch
or Triton kernels. ``kv_t = decay_t * kv_{t-1} + k_t^T v_t``, ``o_t = q_t kv_t``; returns
``(o, final_state)``.
"""


from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .backend import accumulation_dtype, select_backend
from .lightning_torch import lightning_bwd_torch, lightning_fwd_torch


def _check(q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor], s0: Optional[Tensor], chunk_size: int) -> None:
    where = "gradshard.kernels.lightning_attention"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{where}: q, k, v must be 4-D (B, H, T, d); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if q.shape != k.shape:
        raise ValueError(f"{where}: q and k must have the same shape (B, H, T, dk); got {tuple(q.shape)} and {tuple(k.shape)}.")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{where}: v must be (B, H, T, dv) with q's (B, H, T) = {tuple(q.shape[:3])}; got {tuple(v.shape)}.")
    b, h, length, dk = q.shape
    if decay is not None and tuple(decay.shape) not in ((h,), (b, h, length)):
        raise ValueError(f"{where}: decay must be None, (H,) = ({h},) or (B, H, T) = {(b, h, length)}; got {tuple(decay.shape)}.")
    if s0 is not None and tuple(s0.shape) != (b, h, dk, v.shape[-1]):
        raise ValueError(f"{where}: initial_state must be (B, H, dk, dv) = {(b, h, dk, v.shape[-1])}; got {tuple(s0.shape)}.")
    if int(chunk_size) < 1:
        raise ValueError(f"{where}: chunk_size must be >= 1, got {chunk_size}.")
    for name, t in (("q", q), ("k", k), ("v", v), ("decay", decay), ("initial_state", s0)):
        if t is None:
            continue
        if not t.dtype.is_floating_point:
            raise TypeError(f"{where}: {name} must be floating point, got {t.dtype}.")
        if t.device != q.device:
            raise ValueError(f"{where}: {name} is on {t.device} but q is on {q.device}.")


def lightning_dtypes(q: Tensor, k: Tensor, v: Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(output dtype, accumulation/state dtype)."""
    out = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return out, accumulation_dtype(out)


def per_step_decay(decay: Optional[Tensor], b: int, length: int) -> Optional[Tensor]:
    """(H,) -> broadcast (B, H, T) view; (B, H, T) unchanged."""
    if decay is None or decay.dim() == 3:
        return decay
    return decay.view(1, -1, 1).expand(b, decay.shape[0], length)


def run_lightning_forward(q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor], initial_state: Optional[Tensor],
                          chunk_size: int, backend: Optional[str]) -> tuple[Tensor, Tensor]:
    """The forward op's body: ``(o, final_state)`` from the chosen backend."""
    out_dtype, acc = lightning_dtypes(q, k, v)
    steps = per_step_decay(decay, q.shape[0], q.shape[2])
    if select_backend(q, backend) == "triton":
        from .triton.lightning import lightning_fwd_triton

        return lightning_fwd_triton(q, k, v, steps, initial_state, chunk_size, out_dtype, acc)
    o, final = lightning_fwd_torch(q, k, v, steps, initial_state, chunk_size, acc)
    return o.to(out_dtype).contiguous(), final.contiguous()


def run_lightning_backward(q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor], initial_state: Optional[Tensor],
                           grad_o: Tensor, grad_state: Optional[Tensor], chunk_size: int,
                           backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward op's body: (dq, dk, dv, d_decay (decay's shape; empty without decay), d_initial_state)."""
    _, acc = lightning_dtypes(q, k, v)
    b, h, length, _ = q.shape
    steps = per_step_decay(decay, b, length)
    if select_backend(q, backend) == "triton":
        from .triton.lightning import lightning_bwd_triton

        dq, dk, dv, dd, ds0 = lightning_bwd_triton(q, k, v, steps, initial_state, grad_o, grad_state, chunk_size, acc)
    else:
        dq, dk, dv, dd, ds0 = lightning_bwd_torch(q, k, v, steps, initial_state, grad_o, grad_state, chunk_size, acc)
    if decay is None:
        d_decay = q.new_empty((0,))
    else:
        d_decay = (dd.sum((0, 2)) if decay.dim() == 1 else dd).to(decay.dtype).contiguous()
    ds0 = ds0.to(initial_state.dtype if initial_state is not None else acc).contiguous()
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), d_decay, ds0)


def lightning_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay: Optional[Tensor] = None,
    *,
    initial_state: Optional[Tensor] = None,
    chunk_size: int = 64,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """Block-wise causal linear attention with decay; returns ``(o, final_state)`` (see module doc)."""
    _check(q, k, v, decay, initial_state, chunk_size)
    select_backend(q, backend)
    return torch.ops.gradshard.lightning_attention(q, k, v, decay, initial_state, int(chunk_size), backend)
