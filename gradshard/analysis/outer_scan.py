"""Scans whose state is an outer product read by a contraction: the structure, found by shape.

Mamba-2's SSD layer (and every SSD hybrid), and decayed linear attention, canonicalised::

    h = linear_scan(a, left[..., :, None] * right[..., None, :], h0)    h: (batch, T, heads, d1, d2)
    y = einsum(eq, h, query)        one state dim contracted with a per-step query (batch, T, heads, keys)

is causal linear attention with a decay per step and head; plans run it in block form (matmuls
over blocks of steps, never a per-step state): the adjoint's chunked shards
(:mod:`gradshard.plans.adjoint.chunked`), seco's block-read scans
(:mod:`gradshard.plans.chunked.rules_block`). This module only reads graphs: which argument of
the product is ``left``, whether ``a`` is one decay per (batch, step, head) and ``exp`` of a
log-decay, which state dim an einsum contracts.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx as fx

__all__ = ["block_length", "node_shape", "outer_left", "log_decay", "decays_over_state", "log_decay_per_step", "state_contraction"]

aten = torch.ops.aten

_VIEWS = (aten.unsqueeze.default, aten.view.default, aten.reshape.default)


def block_length(values: int, keys: int) -> int:
    """The block length of the block form: about ``sqrt(values * keys)`` (a block's ``C^2`` score
    work against its ``dk * dv`` state work), a power of two in [16, 64]."""
    return int(min(64, max(16, 2 ** round(math.log2(math.sqrt(max(1, values * keys)))))))


def node_shape(n: Any) -> Optional[tuple[int, ...]]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def outer_left(u: Any) -> Optional[int]:
    """Which argument of ``u = left * right`` is ``left`` (..., d1, 1), ``right`` being (..., 1, d2),
    both of ``u``'s full shape but the broadcast dim; None if ``u`` is not such a product."""
    if not isinstance(u, fx.Node) or u.op != "call_function" or u.target is not aten.mul.Tensor:
        return None
    us = node_shape(u)
    if us is None or len(us) != 5 or not all(isinstance(x, fx.Node) for x in u.args[:2]):
        return None
    for i in (0, 1):
        if node_shape(u.args[i]) == us[:-1] + (1,) and node_shape(u.args[1 - i]) == us[:-2] + (1, us[-1]):
            return i
    return None


def log_decay(a: Any) -> Optional[fx.Node]:
    """``z`` when ``a`` is ``exp(z)`` seen through unsqueezes/views."""
    while isinstance(a, fx.Node) and a.op == "call_function" and a.target in _VIEWS:
        a = a.args[0]
    if isinstance(a, fx.Node) and a.op == "call_function" and a.target is aten.exp.default:
        return a.args[0] if isinstance(a.args[0], fx.Node) else None
    return None


def decays_over_state(a: Any, us: tuple[int, ...], time_dim: Optional[int]) -> bool:
    """``a`` is a decay per (batch, step, head) -- each of those dims full or 1 -- constant over the
    state (its last two dims 1), its time dim (if any) at 1."""
    sa = node_shape(a)
    if sa is None or len(sa) > 5 or time_dim not in (None, 1):
        return False
    sa = (1,) * (5 - len(sa)) + sa
    return sa[3:] == (1, 1) and all(d in (1, full) for d, full in zip(sa[:3], us[:3]))


def log_decay_per_step(a: fx.Node) -> bool:
    """``a = exp(z)`` with ``z`` laid out as ``a`` without its two state dims (right-aligned)."""
    z = log_decay(a)
    sz, sa = node_shape(z), node_shape(a)
    if sz is None or sa is None or len(sz) > 3:
        return False
    return (1,) * (3 - len(sz)) + sz == ((1,) * (5 - len(sa)) + sa)[:3]


def state_contraction(use: fx.Node, h: fx.Node) -> Optional[tuple[int, int]]:
    """``(contracted, query_arg)`` when ``use`` is an einsum of the state ``h`` (batch, time, heads,
    d1, d2) with a per-step query ``(batch, time, heads, keys)`` over one state dim, returning
    ``(batch, time, heads, values)``: ``"blhpn,blhn->blhp"`` (-1) or ``"bthk,bthkv->bthv"`` (-2)."""
    if use.op != "call_function" or use.target is not aten.einsum.default or len(use.args[1]) != 2:
        return None
    eq, ops = use.args[0], list(use.args[1])
    if not isinstance(eq, str) or h not in ops or ops[0] is ops[1]:
        return None
    lhs, _, out = eq.replace(" ", "").partition("->")
    subs = lhs.split(",")
    qi = 1 - ops.index(h)
    sh, sq = subs[1 - qi], subs[qi]
    hs, qs = node_shape(h), node_shape(ops[qi])
    if len(sh) != 5 or len(set(sh)) != 5 or len(sq) != 4 or len(out) != 4 or hs is None or len(hs) != 5:
        return None
    if sq[:3] != sh[:3] or out[:3] != sh[:3]:
        return None
    for contracted, kept in ((-1, -2), (-2, -1)):
        if sq[3] == sh[contracted] and out[3] == sh[kept] and qs == hs[:3] + (hs[contracted],):
            return contracted, qi
    return None
