"""LASP: sequence-parallel linear attention, one layer at a time (Sun et al., "Linear
Attention Sequence Parallelism").

Each rank of a group holds one contiguous slice of the sequence (:func:`split_sequence`).
For one linear-attention layer ``kv_t = a_t * kv_{t-1} + k_t^T v_t``, ``o_t = q_t kv_t``,
rank ``r`` computes with ``S`` the state after rank ``r-1``'s last token::

    kv_t = P_t S + kvloc_t                P_t = a_0 a_1 ... a_t   (this rank's gates only)
    o_t  = oloc_t + P_t (q_t S)           oloc, kvloc: the lightning kernel from a zero state
    F    = Floc + G S                     F: the state sent on to rank r+1, G = P_{T-1}

so the expensive local part (the kernel) runs on every rank at once, before ``S`` arrives,
and only the O(B·H·dk·dv) update ``F = Floc + G S`` sits on the rank-to-rank critical path.
Backward mirrors it with ``D = dL/dF`` arriving from rank ``r+1``::

    dS  = dS0 + G D                                  -> sent to rank r-1 first
    dq += P_t do_t S^T      dk += R_t v_t D^T         dv += R_t k_t D
    da_t += d/da_t [sum_s P_s e_s + sum_s R_s c_s]        (two scalar scans, no division)
          e_s = <do_s, q_s S> (+ <D, S> at s = T-1),  c_s = <k_s^T v_s, D>,  R_t = a_{t+1} ... a_{T-1}

where ``dq0, dk0, dv0, da0, dS0`` are the kernel's own backward for ``do`` (run while ``D``
is in flight). Communication per layer and direction: one state of B·H·dk·dv elements,
whatever the sequence length. The forward's received state ``S`` and the kernel's own saved
tensors are kept for backward; nothing is recomputed and nothing is re-sent.

Ordering contract: every rank calls ``lasp_attention`` for the same layers with the same
``layer_id`` s and runs backward through all of them (the dKV chain needs every rank).
Messages are matched by ``(peer, tag)`` with ``tag = 2 * layer_id + phase`` (other traffic
on the same group must avoid these tags); a layer id used twice in one step is matched in
call order. Parameter gradients after backward are per-rank partial sums: reduce them with
:func:`gradshard.runtime.reduce.reduce_gradients` (loss convention documented there).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from gradshard.kernels import lightning_attention
from gradshard.runtime.comm import Communicator, communicator

__all__ = [
    "dkv_label",
    "kv_label",
    "lasp_attention",
    "local_slice",
    "sequence_slice",
    "split_sequence",
]

_FORWARD, _BACKWARD = 0, 1

KernelFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def split_sequence(seq_len: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` token ranges, one per rank, covering ``range(seq_len)``.

    Lengths differ by at most one; the first ``seq_len % world_size`` ranks take the extra
    token (``split_sequence(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]``). Every rank gets
    at least one token, so ``seq_len >= world_size`` is required.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if seq_len < world_size:
        raise ValueError(
            f"cannot split a sequence of {seq_len} tokens over {world_size} ranks: every rank "
            f"needs at least one token; use a smaller sequence-parallel group"
        )
    base, extra = divmod(seq_len, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def sequence_slice(seq_len: int, rank: int, world_size: int) -> tuple[int, int]:
    """The ``[start, stop)`` range of ``rank`` under :func:`split_sequence`."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    return split_sequence(seq_len, world_size)[rank]


def local_slice(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """The part of ``x`` (full sequence along ``dim``) that ``rank`` holds."""
    start, stop = sequence_slice(x.shape[dim], rank, world_size)
    return x.narrow(dim, start, stop - start)


def kv_label(layer_id: int) -> str:
    """CommCounter label of the forward KV-state messages of one layer."""
    return f"lasp.kv[layer={layer_id}]"


def dkv_label(layer_id: int) -> str:
    """CommCounter label of the backward dKV-state messages of one layer."""
    return f"lasp.dkv[layer={layer_id}]"


def _resolve_kernel(kernel: KernelFn | None) -> KernelFn:
    if kernel is not None:
        return kernel
    return lightning_attention


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """KV states travel in at least float32 (half-precision states lose the long-range sum)."""
    return torch.promote_types(dtype, torch.float32)


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    layer_id: int,
) -> None:
    where = f"lasp_attention(layer_id={layer_id})"
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"{where}: expected q, k of shape (B, H, T, dk) and v of shape (B, H, T, dv), got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, h, t, dk = q.shape
    if t == 0:
        raise ValueError(f"{where}: this rank's sequence slice is empty; see split_sequence")
    if decay is not None:
        if decay.shape not in ((h,), (b, h, t)):
            raise ValueError(
                f"{where}: decay must have shape (H,) = ({h},) or (B, H, T) = ({b}, {h}, {t}) "
                f"(this rank's slice of the gates), got {tuple(decay.shape)}"
            )
    if initial_state is not None and initial_state.shape != (b, h, dk, v.shape[-1]):
        raise ValueError(
            f"{where}: initial_state must have shape (B, H, dk, dv) = "
            f"{(b, h, dk, v.shape[-1])}, got {tuple(initial_state.shape)}"
        )


def _decay_products(
    decay: torch.Tensor | None, t: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``P_t = a_0 ... a_t`` and ``R_t = a_{t+1} ... a_{T-1}`` as (B or 1, H, T); None for no decay."""
    if decay is None:
        return None
    a = decay.detach().to(dtype)
    if a.dim() == 1:
        a = a[None, :, None].expand(1, a.shape[0], t)
    prefix = torch.cumprod(a, dim=-1)
    suffix = torch.ones_like(prefix)
    if t > 1:
        suffix[..., :-1] = torch.cumprod(a[..., 1:].flip(-1), dim=-1).flip(-1)
    return prefix, suffix


def _add_row_scaled_matmul(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None
) -> torch.Tensor:
    """``out + scale[..., None] * (a @ b)`` for ``a`` (B, H, T, m), ``b`` (B, H, m, n).

    The product runs in ``b``'s (state) dtype; the result has ``out``'s dtype. Out of place:
    ``out`` may be a kernel output or an autograd gradient that others still reference.
    """
    a = a.detach().to(b.dtype)
    if scale is not None:
        a = a * scale[..., None]
    return (out + torch.matmul(a, b)).to(out.dtype)


class _LaspAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decay: torch.Tensor | None,
        initial_state: torch.Tensor | None,
        comm: Communicator,
        layer_id: int,
        chunk_size: int,
        kernel: KernelFn,
        backend: str | None,
        return_final_state: bool,
    ) -> Any:
        rank, world = comm.rank, comm.world_size
        b, h, t, dk = q.shape
        dv = v.shape[-1]
        sdtype = _state_dtype(q.dtype)
        need_grad = any(ctx.needs_input_grad[:5])

        # 1. Post the receive of the incoming state first: it overlaps the local kernel.
        pending_recv = None
        if rank > 0:
            buf = torch.empty((b, h, dk, dv), dtype=sdtype, device=q.device)
            pending_recv = comm.irecv(
                buf, rank - 1, tag=2 * layer_id + _FORWARD, label=kv_label(layer_id),
                description=f"the KV state of layer {layer_id}",
            )

        # 2. The local part from a zero state; its graph (the kernel's saved tensors) is kept
        #    for backward. On rank > 0 a zero initial state leaf yields dS0 in backward.
        leaves: list[torch.Tensor | None] = [None] * 5
        kwargs: dict[str, Any] = {"chunk_size": chunk_size}
        if backend is not None:
            kwargs["backend"] = backend
        with torch.set_grad_enabled(need_grad):
            leaves[0] = q.detach().requires_grad_(ctx.needs_input_grad[0])
            leaves[1] = k.detach().requires_grad_(ctx.needs_input_grad[1])
            leaves[2] = v.detach().requires_grad_(ctx.needs_input_grad[2])
            if decay is not None:
                leaves[3] = decay.detach().requires_grad_(ctx.needs_input_grad[3])
            if need_grad and (rank > 0 or (initial_state is not None and ctx.needs_input_grad[4])):
                leaves[4] = torch.zeros((b, h, dk, dv), dtype=sdtype, device=q.device,
                                        requires_grad=True)
            o_loc, f_loc = kernel(leaves[0], leaves[1], leaves[2], leaves[3],
                                  initial_state=leaves[4], **kwargs)
        if need_grad and not o_loc.requires_grad:
            raise RuntimeError(
                f"lasp_attention(layer_id={layer_id}): the kernel {getattr(kernel, '__name__', kernel)!r} "
                f"returned an output without an autograd graph; LASP needs a differentiable kernel"
            )
        prods = _decay_products(decay, t, sdtype)

        # 3. The incoming state: from rank-1, or the given initial state on rank 0.
        if pending_recv is not None:
            s_in: torch.Tensor | None = pending_recv.wait()
        elif initial_state is not None:
            s_in = initial_state.detach().to(sdtype)
        else:
            s_in = None

        # 4. Outgoing state (the only thing on the critical path), sent right away.
        final = f_loc.detach().to(sdtype)
        if s_in is not None:
            gain = prods[0][..., -1, None, None] if prods is not None else 1.0
            final = final + gain * s_in
        pending_send = None
        if rank < world - 1:
            pending_send = comm.isend(
                final, rank + 1, tag=2 * layer_id + _FORWARD, label=kv_label(layer_id),
                description=f"the KV state of layer {layer_id}",
            )

        # 5. The incoming state's contribution to the output, while the send is in flight.
        o = o_loc.detach()
        if s_in is not None:
            o = _add_row_scaled_matmul(o, q, s_in, prods[0] if prods is not None else None)

        ctx.comm, ctx.layer_id = comm, layer_id
        ctx.has_decay, ctx.const_decay = decay is not None, decay is not None and decay.dim() == 1
        ctx.has_initial = initial_state is not None and rank == 0
        ctx.initial_dtype = initial_state.dtype if initial_state is not None else None
        if need_grad:
            ctx.edge = torch.autograd.graph.get_gradient_edge(o_loc)
            ctx.leaves = leaves
            ctx.prods = prods
            ctx.save_for_backward(q, k, v, decay, s_in)
        if pending_send is not None:
            pending_send.wait()
        del o_loc, f_loc
        if return_final_state:
            return o, final
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, *rest: torch.Tensor) -> Any:  # type: ignore[override]
        comm, layer_id = ctx.comm, ctx.layer_id
        rank, world = comm.rank, comm.world_size
        q, k, v, decay, s_in = ctx.saved_tensors
        sdtype = _state_dtype(q.dtype)
        b, h, t, dk = q.shape
        dv = v.shape[-1]
        label = dkv_label(layer_id)
        description = f"the gradient of the KV state of layer {layer_id}"

        # 1. Post the receive of D = dL/dF from rank+1 before any local work.
        pending_recv = None
        if rank < world - 1:
            buf = torch.empty((b, h, dk, dv), dtype=sdtype, device=q.device)
            pending_recv = comm.irecv(buf, rank + 1, tag=2 * layer_id + _BACKWARD, label=label,
                                      description=description)

        # 2. The kernel's backward for do alone (D is not needed), overlapping the receive.
        wanted = [i for i, leaf in enumerate(ctx.leaves) if leaf is not None and leaf.requires_grad]
        local = torch.autograd.grad(
            [ctx.edge], [ctx.leaves[i] for i in wanted], [do.contiguous()], allow_unused=True
        )
        grads: list[torch.Tensor | None] = [None] * 5
        for i, g in zip(wanted, local):
            grads[i] = g if g is not None else torch.zeros_like(ctx.leaves[i])
        ctx.edge = ctx.leaves = None  # release the kernel's graph as early as possible

        prefix, suffix = ctx.prods if ctx.prods is not None else (None, None)
        e = None  # e_t = <do_t, q_t S>, for the decay gradient
        if s_in is not None:
            if grads[0] is not None:  # dq += P_t do_t S^T
                grads[0] = _add_row_scaled_matmul(grads[0], do, s_in.transpose(-1, -2), prefix)
            if grads[3] is not None:
                e = (torch.matmul(q.to(sdtype), s_in) * do.to(sdtype)).sum(-1)

        # 3. D from rank+1 (plus the caller's gradient of the returned final state).
        d_final: torch.Tensor | None = pending_recv.wait() if pending_recv is not None else None
        if rest and rest[0] is not None:
            user = rest[0].to(sdtype)
            d_final = user if d_final is None else d_final + user

        # 4. dS = dS0 + G D goes to rank-1 first; it is all rank-1 waits for.
        # grads[4] (dS0) exists on rank > 0 and on rank 0 when initial_state needs a gradient.
        pending_send = None
        d_state = grads[4]
        if d_state is not None and d_final is not None:
            gain = prefix[..., -1, None, None] if prefix is not None else 1.0
            d_state = d_state + gain * d_final
        if rank > 0:
            pending_send = comm.isend(d_state, rank - 1, tag=2 * layer_id + _BACKWARD,
                                      label=label, description=description)

        # 5. The rest of D's contribution: dk, dv and the gates.
        c = None  # c_t = <k_t^T v_t, D>
        if d_final is not None:
            if grads[1] is not None:  # dk += R_t v_t D^T
                grads[1] = _add_row_scaled_matmul(grads[1], v, d_final.transpose(-1, -2), suffix)
            if grads[2] is not None:  # dv += R_t k_t D
                grads[2] = _add_row_scaled_matmul(grads[2], k, d_final, suffix)
            if grads[3] is not None:
                c = (torch.matmul(k.to(sdtype), d_final) * v.to(sdtype)).sum(-1)
        if grads[3] is not None and (e is not None or c is not None):
            grads[3] = grads[3] + _decay_grad_correction(
                decay, prefix, suffix, e, c, s_in, d_final, ctx.const_decay
            ).to(grads[3].dtype)

        if pending_send is not None:
            pending_send.wait()
        d_initial = None
        if rank == 0 and ctx.has_initial and d_state is not None:
            d_initial = d_state.to(ctx.initial_dtype)
        return (grads[0], grads[1], grads[2], grads[3], d_initial,
                None, None, None, None, None, None)


def _scan(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``h_t = a_t h_{t-1} + u_t`` (``h_{-1} = 0``) along the last dim, by log-depth doubling.

    Division- and log-free (exact for gates equal to 0); O(n log n) work on the small
    (B, H, T) scalars of the decay gradient, which is negligible next to the attention.
    """
    a, h = a.clone(), u.clone()
    n, shift = h.shape[-1], 1
    while shift < n:
        h_new = h.clone()
        h_new[..., shift:] += a[..., shift:] * h[..., :-shift]
        a_new = a.clone()
        a_new[..., shift:] *= a[..., :-shift]
        a, h, shift = a_new, h_new, 2 * shift
    return h


def _decay_grad_correction(
    decay: torch.Tensor,
    prefix: torch.Tensor,
    suffix: torch.Tensor,
    e: torch.Tensor | None,
    c: torch.Tensor | None,
    s_in: torch.Tensor | None,
    d_final: torch.Tensor | None,
    const: bool,
) -> torch.Tensor:
    """Gradient of ``sum_t P_t e_t + sum_t R_t c_t + G <D, S>`` w.r.t. the gates ``a``.

    Without dividing by gates::

        d/da_t sum_s P_s e_s = P_{t-1} y_t,  y_t = e_t + a_{t+1} y_{t+1}   (reverse scan)
        d/da_t sum_s R_s c_s = R_t z_{t-1},  z_t = a_t z_{t-1} + c_t      (forward scan)

    and ``G <D, S>`` enters as an extra ``e_{T-1}``. For a constant per-head decay the
    per-step gradient is summed over batch and time.
    """
    shape = torch.broadcast_shapes(prefix.shape, (e if e is not None else c).shape)
    a = decay.detach().to(prefix.dtype)
    a = (a[None, :, None] if const else a).expand(shape)
    total = torch.zeros(shape, dtype=prefix.dtype, device=prefix.device)
    if e is not None:
        e = e.clone()
        if d_final is not None:
            e[..., -1] += (d_final * s_in).sum((-1, -2))
        a_next = torch.cat([a[..., 1:], torch.zeros_like(a[..., :1])], -1)
        y = _scan(a_next.flip(-1), e.flip(-1)).flip(-1)
        p_prev = torch.cat([torch.ones_like(prefix[..., :1]), prefix[..., :-1]], -1)
        total = total + p_prev * y
    if c is not None:
        z = _scan(a, c)
        z_prev = torch.cat([torch.zeros_like(z[..., :1]), z[..., :-1]], -1)
        total = total + suffix * z_prev
    return total.sum((0, 2)) if const else total


def lasp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None = None,
    *,
    group: Any | None = None,
    layer_id: int,
    chunk_size: int = 64,
    comm: Communicator | None = None,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
    kernel: KernelFn | None = None,
    backend: str | None = None,
) -> Any:
    """Linear attention over a sequence split across the ranks of ``group`` (LASP).

    Args:
        q, k: ``(B, H, T_r, dk)``; v: ``(B, H, T_r, dv)`` -- this rank's contiguous slice
            (rank order = sequence order; slices may differ in length, see
            :func:`split_sequence`).
        decay: ``None``, ``(H,)`` constant per head, or ``(B, H, T_r)`` per-step gates (this
            rank's slice), meant to lie in ``(0, 1]`` (nothing divides by them; 0 is
            exact). ``kv_t = decay_t * kv_{t-1} + k_t^T v_t``.
        group: the sequence-parallel ``ProcessGroup`` (any group object; ranks are group ranks).
        layer_id: unique per layer (message tags ``2*layer_id`` and ``2*layer_id + 1``).
        chunk_size: passed to the kernel.
        comm: a :class:`~gradshard.runtime.comm.Communicator` (timeout); default: the
            group's shared one.
        initial_state: ``(B, H, dk, dv)`` state before the first token of the whole
            sequence; used (and differentiated) on rank 0 only, ignored on the others.
        return_final_state: also return the state after this rank's last token (on the last
            rank: the final state of the whole sequence); differentiable.
        kernel: the local kernel (default ``gradshard.kernels.lightning_attention``).
        backend: passed to the kernel when given.

    Returns ``o`` of shape ``(B, H, T_r, dv)`` (and the final state if asked), equal to the
    matching slice of single-process linear attention over the whole sequence. The KV
    state travels in at least float32.
    """
    if comm is None:
        if group is None:
            raise ValueError("lasp_attention needs group= (a ProcessGroup) or comm=")
        comm = communicator(group)
    elif group is not None and comm.group is not group:
        raise ValueError("lasp_attention: comm was built for a different group than group=")
    if not isinstance(layer_id, int) or layer_id < 0:
        raise ValueError(f"lasp_attention: layer_id must be a non-negative int, got {layer_id!r}")
    _check_inputs(q, k, v, decay, initial_state, layer_id)
    return _LaspAttention.apply(
        q, k, v, decay, initial_state, comm, layer_id, chunk_size, _resolve_kernel(kernel),
        backend, return_final_state,
    )
