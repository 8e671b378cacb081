"""Causal attention of one chunk of queries against the KV cache plus the chunk itself.

Queries are steps ``[s, e)``; keys/values are the cached steps ``[0, s)`` (``k_past``) and
the chunk's own steps ``[s, e)`` (``k_cur``). With the row-wise log-sum-exps ``l_p`` and
``l_c`` of the two parts::

    o = o_p * exp(l_p - l) + o_c * exp(l_c - l),      l = logaddexp(l_p, l_c)
      = o_c + (o_p - o_c) * sigmoid(l_p - l_c)

where ``o_p`` is unmasked attention over the past and ``o_c`` causal attention inside the
chunk. The backward runs the flash backward of each part with the *merged* ``o`` and
``l`` (its softmax probabilities ``exp(s - l)`` are then the global ones), so no
``(e - s) x s`` score matrix is ever stored: memory is the cache plus O(chunk).
Grouped-query attention is native (key head ``h // n_rep`` serves query head ``h``).

On CPU this uses ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``).
Elsewhere (CUDA) it is one ``F.scaled_dot_product_attention`` over the concatenated keys with
``causal_lower_right`` (:func:`lower_right_attention`): torch runs it as flash attention
(half precision) or memory-efficient attention with a bottom-right causal mask type (float32),
neither storing a score matrix. An explicit boolean mask there, with grouped-query heads, would
select the math kernel, which saves the ``c x T`` probabilities of every head for the backward.

*Stash* (:class:`AttentionStash`, used when the program is composed with Inductor): the
forward keeps each chunk's merged ``o`` and ``l`` (one activation per attention layer,
``B*H*T*(D+1)`` values), and the backward recompute of that chunk takes them instead of
running the two flash forwards again; its flash backwards get the same ``o`` and ``l``
(bit for bit: the same kernels on the same inputs), so the gradient is unchanged. The
chunk evaluator names the slot (:func:`stash_slot`) around the attention node it computes.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Hashable, Iterator

import torch
import torch.nn.functional as F

from gradshard.passes.meta_propagate import device_type

__all__ = ["prefix_attention", "prefix_attention_reference", "lower_right_attention", "AttentionStash",
           "stash_slot"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _prefix_forward(q: torch.Tensor, kp: torch.Tensor | None, vp: torch.Tensor | None, kc: torch.Tensor,
                    vc: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged output ``o`` and log-sum-exp ``l`` (module doc)."""
    oc, lc = _flash(q, kc, vc, 0.0, True, scale=scale)
    if kp is None:
        return oc, lc
    op, lp = _flash(q, kp, vp, 0.0, False, scale=scale)
    lse = torch.logaddexp(lp, lc)
    w = torch.sigmoid(lp - lc).unsqueeze(-1).to(op.dtype)  # exp(lp - lse)
    return oc + (op - oc) * w, lse


class AttentionStash:
    """Per chunk, the ``(o, l)`` the forward computed for each attention node and window."""

    def __init__(self) -> None:
        self.chunks: dict[int, dict[Hashable, tuple[torch.Tensor, torch.Tensor]]] = {}

    def put(self, chunk: int, key: Hashable, o: torch.Tensor, lse: torch.Tensor) -> None:
        self.chunks.setdefault(chunk, {})[key] = (o, lse)

    def take(self, chunk: int, key: Hashable) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stashed pair, removed (each is used by one backward recompute)."""
        return self.chunks.get(chunk, {}).pop(key, None)

    def drop(self, chunk: int) -> None:
        self.chunks.pop(chunk, None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.chunks.values() for pair in c.values() for t in pair)


_SLOT: contextvars.ContextVar[tuple[AttentionStash, int, Hashable] | None] = contextvars.ContextVar(
    "gs_attention_stash_slot", default=None)


@contextlib.contextmanager
def stash_slot(stash: AttentionStash, chunk: int, key: Hashable) -> Iterator[None]:
    """Inside: :func:`prefix_attention` stores (no grad) or reuses (grad) ``stash[chunk][key]``."""
    token = _SLOT.set((stash, chunk, key))
    try:
        yield
    finally:
        _SLOT.reset(token)


class _PrefixFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kp, vp, kc, vc, scale, stashed=None):  # type: ignore[override]
        if stashed is None:
            o, lse = _prefix_forward(q, kp, vp, kc, vc, scale)
        else:  # the forward's own values (module doc): a fresh tensor object, the same storage
            o, lse = stashed[0].detach(), stashed[1]
        ctx.scale = scale
        ctx.has_past = kp is not None
        ctx.save_for_backward(q, kp if kp is not None else q.new_empty(0), vp if vp is not None else q.new_empty(0),
                              kc, vc, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, kp, vp, kc, vc, o, lse = ctx.saved_tensors
        do = do.contiguous()
        dq, dkc, dvc = _flash_backward(do, q, kc, vc, o, lse, True, ctx.scale)
        dkp = dvp = None
        if ctx.has_past:
            dqp, dkp, dvp = _flash_backward(do, q, kp, vp, o, lse, False, ctx.scale)
            dq = dq + dqp
        return dq, dkp, dvp, dkc, dvc, None, None


def _flash_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float | None) -> tuple[torch.Tensor, ...]:
    """The CPU flash backward; grouped key heads repeated when there are fewer (batch, key head) pairs
    than threads.

    With grouped-query heads the kernel splits its work by key head (each accumulates the gradient
    of its group's query heads), so ``B * Hkv`` pairs busy at most that many threads: at B=1 and one
    key head, 43 vs 26 ms on 2 threads (T=4096, D=4). Repeated, every query head is a task; the key
    gradients are then summed over each group (the same sum, in another order).
    """
    rep = q.shape[-3] // k.shape[-3]
    if rep == 1 or k.shape[:-2].numel() >= torch.get_num_threads():
        return _flash_bwd(do, q, k, v, o, lse, 0.0, causal, scale=scale)
    dq, dk, dv = _flash_bwd(do, q, k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3), o, lse, 0.0,
                            causal, scale=scale)
    return dq, dk.unflatten(-3, (-1, rep)).sum(-3), dv.unflatten(-3, (-1, rep)).sum(-3)


def _usable_flash(q: torch.Tensor, *rest: torch.Tensor | None) -> bool:
    ts = [q, *[t for t in rest if t is not None]]
    return all(device_type(t) == "cpu" and t.dtype == q.dtype for t in ts) and q.dtype in _FLASH_DTYPES


def prefix_attention(q: torch.Tensor, k_past: torch.Tensor | None, v_past: torch.Tensor | None,
                     k_cur: torch.Tensor, v_cur: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of queries ``q`` (B, H, c, D) at steps ``[s, s+c)`` over keys ``[0, s+c)``.

    ``k_past``/``v_past``: (B, Hkv, s, D) or None when ``s == 0``; ``k_cur``/``v_cur``:
    (B, Hkv, c, D). ``H`` must be a multiple of ``Hkv``.
    """
    if k_past is not None and k_past.shape[-2] == 0:
        k_past = v_past = None
    if _usable_flash(q, k_past, v_past, k_cur, v_cur):
        slot = _SLOT.get()
        if slot is None:
            return _PrefixFlash.apply(q, k_past, v_past, k_cur, v_cur, scale)
        stash, chunk, key = slot
        if not torch.is_grad_enabled():  # the forward: keep what the backward recompute would redo
            o, lse = _prefix_forward(q, k_past, v_past, k_cur, v_cur, scale)
            stash.put(chunk, key, o, lse)
            return o
        return _PrefixFlash.apply(q, k_past, v_past, k_cur, v_cur, scale, stash.take(chunk, key))
    if device_type(q) != "cpu":
        k = k_cur if k_past is None else torch.cat([k_past, k_cur], dim=-2)
        v = v_cur if v_past is None else torch.cat([v_past, v_cur], dim=-2)
        return lower_right_attention(q, k, v, scale)
    return prefix_attention_reference(q, k_past, v_past, k_cur, v_cur, scale)


def lower_right_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    """Queries ``q`` (B, H, c, D), the last ``c`` of keys ``k``/``v`` (B, Hkv, S, D), each seeing the keys
    up to its own step (causal, aligned bottom-right); ``H`` a multiple of ``Hkv``.

    ``causal_lower_right`` lets torch pick a fused kernel with that mask built in; its fused paths
    take equal head counts only (``enable_gqa`` is dropped there), so grouped key heads are
    repeated first: one ``(B, H, S, D)`` copy per call, far below the ``(B, H, c, S)`` probabilities
    the math kernel would keep.
    """
    from torch.nn.attention.bias import causal_lower_right

    rep = q.shape[-3] // k.shape[-3]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]),
                                          scale=scale)


def prefix_attention_reference(q: torch.Tensor, k_past: torch.Tensor | None, v_past: torch.Tensor | None,
                               k_cur: torch.Tensor, v_cur: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Same result with plain SDPA and an explicit bottom-right causal mask (any device)."""
    k = k_cur if k_past is None else torch.cat([k_past, k_cur], dim=-2)
    v = v_cur if v_past is None else torch.cat([v_past, v_cur], dim=-2)
    c, total = q.shape[-2], k.shape[-2]
    mask = torch.ones(c, total, dtype=torch.bool, device=q.device).tril(total - c)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[-3] != k.shape[-3])
