"""Chunk rules for a scan read only through contractions: block form, no per-step states.

Mamba-2's SSD layer (and every SSD hybrid), and decayed linear attention, canonicalise to::

    h = linear_scan(a, left[..., :, None] * right[..., None, :], h0)    (batch, T, heads, d1, d2)
    y = einsum(eq, h, query)                                            one state dim contracted

Evaluated as written, every chunk formed each step's ``d1 x d2`` state per head -- in its
forward, again in its recompute, and kept for the backward (transformers' Mamba-2 at T=1K:
seco peaked above plain ``torch.compile``'s budgeted memory). Here (found by structure,
:mod:`gradshard.analysis.outer_scan`, not by model):

* the einsum computes ``y`` on its window ``[lo, hi)`` in block form -- SSD's
  (:func:`gradshard.kernels.ssd_torch.ssd_chunk_scan`) when ``a = exp(z)``, else the
  ``gradshard::lightning_attention`` op -- from the state before the window, the scan's value at
  step ``lo - 1`` (the chunk's carry, a cache point of one step, or ``h0``);
* the scan keeps its node (it is the carry across chunks) but is only ever asked for a few
  steps: a carry, the steps its cache keeps. For a window inside the chunk it sums the steps
  from the chunk's start into the state with one contraction (:func:`final_state`) and forms
  per-step states for the window's steps only.

Both are plain differentiable ops: the backward recompute differentiates the block form, and
the gradient reaching the carry goes to the chunk before, as for any cache point. Exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.analysis.outer_scan import (
    block_length, decays_over_state, log_decay_per_step, log_decay, node_shape, outer_left, state_contraction)
from gradshard.kernels.backend import accumulation_dtype
from gradshard.ops.lightning import block_scan, decay_per_head
from gradshard.plans.chunked.frames import SKIP, Demand
from gradshard.plans.chunked.rules import BuildCtx, ExtraReads, NodeRule, _arg

__all__ = ["BlockScan", "match_block_scan", "block_states_rule", "block_readout_rule", "final_state"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class BlockScan:
    """A forward ``linear_scan`` whose ``u`` is ``left * right`` and whose every use is a contraction."""

    scan: fx.Node
    a: fx.Node  # (batch | 1, T | 1, heads | 1, 1, 1)
    z: Optional[fx.Node]  # a = exp(z), z per (batch, step, head): SSD's block form from z
    left: fx.Node  # (batch, T, heads, d1, 1)
    right: fx.Node  # (batch, T, heads, 1, d2)
    h0: Optional[fx.Node]  # (batch, heads, d1, d2)
    backend: Optional[str]


def match_block_scan(scan: Any, bc: BuildCtx) -> Optional[BlockScan]:
    """The :class:`BlockScan` of ``scan`` (a ``gradshard::linear_scan`` node), or None."""
    if not isinstance(scan, fx.Node) or scan.target is not torch.ops.gradshard.linear_scan.default:
        return None
    a, u, h0 = scan.args[0], scan.args[1], _arg(scan, 2, "h0")
    if _arg(scan, 3, "reverse", False) or not scan.users:
        return None
    i = outer_left(u)
    us = node_shape(u)
    if i is None or len(u.users) != 1 or us is None:
        return None
    left, right = u.args[i], u.args[1 - i]
    for n in (left, right):
        fr = bc.frame(n)
        if len(fr) != 1 or fr[0].dim != 1 or not fr[0].pure(us[1]):
            return None
    sa, fr = node_shape(a), bc.frame(a)  # the op's schema makes ``a`` a tensor
    if not isinstance(a, fx.Node) or sa is None or len(sa) != 5 or len(fr) > 1 or (fr and fr[0].dim != 1):
        return None
    if not decays_over_state(a, us, 1 if fr else None):
        return None
    if isinstance(h0, fx.Node) and (bc.frame(h0) or node_shape(h0) != (us[0],) + us[2:]):
        return None
    for use in scan.users:
        found = state_contraction(use, scan)
        if found is None or len(bc.frame(use.args[1][found[1]])) != 1:
            return None
    z = log_decay(a) if log_decay_per_step(a) and fr else None
    return BlockScan(scan, a, z, left, right, h0 if isinstance(h0, fx.Node) else None, _arg(scan, 4, "backend"))


# --------------------------------------------------------------------------- block form


def _window(ev: Any, node: Optional[fx.Node], lo: int, hi: int) -> Optional[Tensor]:
    """``node`` on steps ``[lo, hi)`` (whole when it has no time dim), or None."""
    if node is None:
        return None
    return ev.value(node, ((lo, hi),) if ev.program.rules[node.name].frame else ())


def _decays(bs: BlockScan, ev: Any, lo: int, hi: int, like: Tensor) -> tuple[Tensor, bool]:
    """The decay per (batch, step, head) on ``[lo, hi)`` like ``like``'s leading dims: ``(z, True)``
    for a log-decay, else ``(a, False)``."""
    if bs.z is not None:
        return decay_per_head(_window(ev, bs.z, lo, hi), like), True
    return decay_per_head(_window(ev, bs.a, lo, hi), like, state_dims=2), False


def _factors(bs: BlockScan, ev: Any, lo: int, hi: int) -> tuple[Tensor, Tensor]:
    """``left`` (b, n, H, d1) and ``right`` (b, n, H, d2) on ``[lo, hi)``."""
    return _window(ev, bs.left, lo, hi).squeeze(-1), _window(ev, bs.right, lo, hi).squeeze(-2)


def final_state(decay: Optional[Tensor], is_log: bool, left: Tensor, right: Tensor, h: Optional[Tensor]) -> Tensor:
    """The state after the window's steps from ``h`` (b, H, d1, d2; None: zero), without forming
    per-step states: ``prod(a) h + sum_j (prod_{l > j} a_l) left_j right_j^T``, the products as
    suffix sums of ``z`` (or suffix products of ``a``) taken whole, never as differences."""
    b, n, heads = left.shape[:3]
    out = left.dtype if h is None else torch.promote_types(left.dtype, h.dtype)
    acc = accumulation_dtype(torch.promote_types(out, right.dtype))  # half inputs: summed in float32
    left, right = left.to(acc), right.to(acc)
    decay = None if decay is None else decay.to(acc)
    if decay is None:
        w = left.new_ones(b, n, heads)
        total = left.new_ones(b, heads)
    elif is_log:
        after = torch.cat([decay[:, 1:], decay.new_zeros(b, 1, heads)], 1)  # z_{j+1}, 0 at the end
        suffix = after.flip(1).cumsum(1).flip(1)  # sum_{l > j} z_l
        w, total = torch.exp(suffix), torch.exp(suffix[:, 0] + decay[:, 0])
    else:
        after = torch.cat([decay[:, 1:], decay.new_ones(b, 1, heads)], 1)
        w = after.flip(1).cumprod(1).flip(1)
        total = w[:, 0] * decay[:, 0]
    added = torch.einsum("bjhp,bjhn->bhpn", left * w[..., None], right)
    return (added if h is None else added + total[..., None, None] * h.to(acc)).to(out)


def _readout(bs: BlockScan, ev: Any, lo: int, hi: int, h: Optional[Tensor], query: Tensor, contracted: int) -> Tensor:
    """``y`` (b, n, H, values) on ``[lo, hi)`` from the state ``h`` before it, in block form."""
    left, right = _factors(bs, ev, lo, hi)
    values, keys = (left, right) if contracted == -1 else (right, left)
    decay, is_log = _decays(bs, ev, lo, hi, values)
    args = (decay, is_log, values, keys, query, h, contracted, block_length(values.shape[-1], keys.shape[-1]),
            bs.backend)
    # SSD's block form is some thirty small ops: compiled when the program is (one kernel's op otherwise)
    y, _ = ev.call(block_scan, *args) if is_log else block_scan(*args)
    return y


def _state_before(bs: BlockScan, ev: Any, lo: int) -> Optional[Tensor]:
    """The scan's state entering step ``lo``: ``h0`` (or None: zero) at 0, else its value at ``lo - 1``."""
    if lo == 0:
        return _window(ev, bs.h0, 0, 0)
    return ev.value(bs.scan, ((lo - 1, lo),)).squeeze(1)


# --------------------------------------------------------------------------- rules


class _Reads(ExtraReads):
    """The factors and decay on a window, and the scan's step before another (the carry)."""

    def __init__(self, bs: BlockScan, from_chunk_start: bool) -> None:
        self.bs, self.from_start = bs, from_chunk_start
        self.hull = not from_chunk_start  # the scan: a carry at the chunk's start, cached steps at its end
        self.factors = tuple(n.name for n in (bs.left, bs.right, bs.z if bs.z is not None else bs.a))
        self.nodes = (*self.factors, bs.scan.name)

    def windows(self, win: tuple[int, int], start: int) -> list[tuple[str, tuple[int, int]]]:
        lo, hi = win
        first = min(start, lo) if self.from_start else lo  # the scan sums the chunk's steps before lo
        out = [(n, (first, hi)) for n in self.factors]
        return out + [(self.bs.scan.name, (first - 1, first))] if first > 0 else out


def _states_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    """The scan on a window of the chunk (a carry, cached steps): the steps before it summed from
    the chunk's start, per-step states for the window's own steps only."""
    (lo, hi), = demand
    bs: BlockScan = ev.program.rules[node.name].data
    start = min(ev.start, lo)
    h = _state_before(bs, ev, start)
    left, right = _factors(bs, ev, start, hi)  # one window (_Reads): the chunk's steps up to hi
    decay, is_log = _decays(bs, ev, start, hi, left)
    k = lo - start
    if k:
        part = lambda t: None if t is None else t[:, :k]  # noqa: E731
        h = final_state(part(decay), is_log, part(left), part(right), h)
    a = _window(ev, bs.a, start, hi)
    a = a if a.shape[1] == 1 else a[:, k:]
    return torch.ops.gradshard.linear_scan(a, left[:, k:, ..., None] * right[:, k:, ..., None, :], h, False,
                                           bs.backend)


def block_states_rule(rule: NodeRule, bs: BlockScan) -> NodeRule:
    """The carried scan ``rule`` of ``bs.scan`` run as :func:`_states_run`: ``u`` is never evaluated."""
    slots = list(rule.slots)
    u_slot = 1 if isinstance(bs.scan.args[0], fx.Node) else 0
    slots[u_slot] = SKIP
    rule.slots, rule.run, rule.data, rule.reads = tuple(slots), _states_run, bs, _Reads(bs, True)
    rule.note = "linear_scan read by contractions: per-step states only for the steps asked (carries, cache)"
    return rule


def _readout_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    (lo, hi), = demand
    bs, contracted, query_slot = ev.program.rules[node.name].data
    y = _readout(bs, ev, lo, hi, _state_before(bs, ev, lo), vals[query_slot], contracted)
    return y.to(node.meta["val"].dtype).contiguous()


def block_readout_rule(rule: NodeRule, node: fx.Node, bs: BlockScan) -> NodeRule:
    """The einsum ``rule`` of a contraction of ``bs.scan`` run in block form (:func:`_readout_run`):
    the state is not evaluated (the run reads the step before its window); a mixer (it reads the past)."""
    contracted, query_arg = state_contraction(node, bs.scan)
    ops = list(node.args[1])
    slots = list(rule.slots)
    h_slot, query_slot = ops.index(bs.scan), 1 - ops.index(bs.scan)
    slots[h_slot] = SKIP
    rule.slots, rule.run, rule.kind = tuple(slots), _readout_run, "mixer"
    rule.data, rule.reads = (bs, contracted, query_slot), _Reads(bs, False)
    rule.note = (f"contracts `{bs.scan.name}`'s state in block form from the state before its window "
                 f"({'SSD block form' if bs.z is not None else 'lightning op'}; no per-step states)")
    return rule
