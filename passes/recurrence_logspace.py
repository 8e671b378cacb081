"""Rewrite Heinsen's log-space scan as ``gradshard::linear_scan`` (minGRU / minLSTM style).

Heinsen (2023) computes ``h_t = a_t h_{t-1} + u_t`` for ``u > 0`` in log space, and minGRU /
minLSTM ("Were RNNs All We Needed?", 2024) use exactly this form::

    before:  A = cumsum(log_a, d)                      # or cumsum(pad(log_a)), pad(cumsum(log_a)):
                                                       # a leading zero step
             log_h = A + logcumsumexp(log_u - A, d)
             h = exp(log_h)
    after:   h = linear_scan(exp(log_a), exp(log_u))   # time moved to dim 1 and back
                                                       # (exp(pad(log_a)) for the padded form)

The padded form is how these models prepend ``log h0`` to ``log_u`` (the pad makes ``a = 1`` at
that step). The rewrite is made only when every use of ``log_h`` is ``exp``: the value then
leaves log space anyway, so computing it linearly changes no overflow behaviour, and a sum of
positive terms has no cancellation. A ``log_h`` used in log space is left alone (reported as a
``time_mixer`` region: exact, no memory saving).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.passes.recurrence_fold import time_slice
from gradshard.passes.recurrence_graph import emit_node, live_nodes, live_users, time_from_dim1, time_to_dim1

aten = torch.ops.aten

__all__ = ["HeinsenScan", "match_heinsen_scans", "rewrite_heinsen_scans"]

_PADS = (aten.constant_pad_nd.default, aten.pad.default)


@dataclass(frozen=True)
class HeinsenScan:
    """One matched ``A + logcumsumexp(log_u - A)``: its nodes and the time dim."""

    log_a: fx.Node
    log_u: fx.Node
    pad: Optional[fx.Node]  # the leading zero pad of ``log_a`` or of its cumsum (None: unpadded)
    log_h: fx.Node
    exps: tuple[fx.Node, ...]  # the users ``exp(log_h)``
    time_dim: int


def _dim(node: fx.Node, i: int) -> int:
    return int(node.args[i]) % max(node.meta["val"].dim(), 1)


def _leading_pad_of(pad: fx.Node, td: int) -> bool:
    """``pad`` adds exactly one zero before dim ``td`` and nothing else."""
    spec = list(pad.args[1])
    value = pad.args[2] if len(pad.args) > 2 else pad.kwargs.get("value", 0.0)
    if pad.target is aten.pad.default:
        mode = pad.args[2] if len(pad.args) > 2 else pad.kwargs.get("mode", "constant")
        value = pad.args[3] if len(pad.args) > 3 else pad.kwargs.get("value", None)
        if mode != "constant":
            return False
    rank = pad.meta["val"].dim()
    want = [0] * (2 * rank)
    want[2 * (rank - 1 - td)] = 1  # (left, right) pairs from the last dim backwards
    spec = spec + [0] * (len(want) - len(spec))
    return spec == want and (value is None or float(value) == 0.0)


def _cumulative_log_a(node: Any, td: int) -> Optional[tuple[fx.Node, Optional[fx.Node]]]:
    """``(log_a, pad)`` if ``node`` is ``cumsum(log_a, td)`` with at most one leading zero step,
    padded before the cumsum (``cumsum(pad(log_a))``) or after it (``pad(cumsum(log_a))``)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    pad = None
    if node.target in _PADS:
        if not _leading_pad_of(node, td):
            return None
        pad, node = node, node.args[0]
    if not isinstance(node, fx.Node) or node.target is not aten.cumsum.default or _dim(node, 1) != td:
        return None
    log_a = node.args[0]
    if pad is None and isinstance(log_a, fx.Node) and log_a.target in _PADS and _leading_pad_of(log_a, td):
        pad, log_a = log_a, log_a.args[0]
    return (log_a, pad) if isinstance(log_a, fx.Node) else None


def match_heinsen_scans(gm: fx.GraphModule, time_dims: dict[str, tuple[int, ...]]) -> list[HeinsenScan]:
    """Every log-space scan of the module doc in ``gm`` whose scan dim is a time dim."""
    live = live_nodes(gm)
    found = []
    for lse in gm.graph.nodes:
        if lse.op != "call_function" or lse.target is not aten.logcumsumexp.default or lse not in live:
            continue
        td = _dim(lse, 1)
        if td not in time_dims.get(lse.name, ()) or lse.meta["val"].dim() < 2:
            continue
        diff = lse.args[0]
        if not isinstance(diff, fx.Node) or diff.target is not aten.sub.Tensor or diff.kwargs.get("alpha", 1) != 1:
            continue
        log_u, big_a = diff.args[:2]
        cum = _cumulative_log_a(big_a, td)
        if cum is None or not isinstance(log_u, fx.Node):
            continue
        va, vh = big_a.meta["val"], lse.meta["val"]
        if va.dim() != vh.dim() or va.shape[td] != vh.shape[td]:
            continue  # a broadcast A would not be a per-step decay along time
        users = live_users(lse, live)
        if len(users) != 1 or users[0].target is not aten.add.Tensor or big_a not in users[0].args[:2]:
            continue
        log_h = users[0]
        exps = live_users(log_h, live)
        if not exps or any(e.target is not aten.exp.default for e in exps):
            continue
        if tuple(log_u.meta["val"].shape) != tuple(log_h.meta["val"].shape):
            continue
        found.append(HeinsenScan(cum[0], log_u, cum[1], log_h, tuple(exps), td))
    return found


def _prepended_initial_state(m: HeinsenScan) -> Optional[tuple[fx.Node, fx.Node]]:
    """``(log_h0, log_u_rest)`` when the padded form's ``log_u`` is ``cat([log_h0, rest], time)``
    with one step of ``log_h0``: the scan is then ``rest`` scanned from the state ``h0``."""
    cat = m.log_u
    if m.pad is None or cat.target is not aten.cat.default:
        return None
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if len(parts) != 2 or int(dim) % cat.meta["val"].dim() != m.time_dim:
        return None
    first, rest = parts
    if not isinstance(first, fx.Node) or first.meta["val"].shape[m.time_dim] != 1:
        return None
    return first, rest


def _rewrite_one(gm: fx.GraphModule, m: HeinsenScan) -> str:
    graph = gm.graph
    rank = m.log_h.meta["val"].dim()
    td = m.time_dim
    trace = m.log_h.meta.get("stack_trace")
    split = _prepended_initial_state(m)
    with graph.inserting_before(m.log_h):
        if split is None:
            log_a, log_u, h0 = m.log_a, m.log_u, None
            if m.pad is not None:
                log_a = emit_node(graph, m.pad.target, (m.log_a, *m.pad.args[1:]), trace)
        else:  # the pad's a = 1 step only carries h0 in: start the scan from it instead
            log_a, log_u = m.log_a, split[1]
            first = emit_node(graph, aten.exp.default, (split[0],), trace)
            h0 = emit_node(graph, aten.select.int, (time_to_dim1(graph, first, td, rank, trace), 1, 0), trace)
        a1 = time_to_dim1(graph, emit_node(graph, aten.exp.default, (log_a,), trace), td, rank, trace)
        u1 = time_to_dim1(graph, emit_node(graph, aten.exp.default, (log_u,), trace), td, rank, trace)
        scan = emit_node(graph, torch.ops.gradshard.linear_scan.default, (a1, u1, h0, False, None), trace)
        scan.meta["gs_written_as"] = "logcumsumexp"
        h = time_from_dim1(graph, scan, td, rank, trace)
        full = h if split is None else emit_node(graph, aten.cat.default, ([first, h], td), trace)
    for e in m.exps:
        e.replace_all_uses_with(full)
    if split is not None:
        _read_slices_from_the_scan(graph, full, h, td)
    note = " (initial state unfolded from the prepended step)" if split is not None else ""
    return f"logcumsumexp at {m.log_h.name} -> {scan.name}{note}"


def _read_slices_from_the_scan(graph: fx.Graph, full: fx.Node, h: fx.Node, td: int) -> None:
    """``cat([h0, h])[..., s:e]`` with ``s >= 1`` (how these models drop the h0 step) reads ``h``."""
    length = full.meta["val"].shape[td]
    rank = full.meta["val"].dim()
    for user in list(full.users):
        bounds = time_slice(user, rank, td)
        if bounds is None or bounds[0] is not full or bounds[1] < 1:
            continue
        start, end = bounds[1] - 1, bounds[2] - 1
        if start == 0 and end >= length - 1:
            user.replace_all_uses_with(h)
            continue
        with graph.inserting_before(user):
            new = emit_node(graph, aten.slice.Tensor, (h, td, start, end, 1), user.meta.get("stack_trace"))
        user.replace_all_uses_with(new)


def rewrite_heinsen_scans(gm: fx.GraphModule, time_dims: dict[str, tuple[int, ...]]) -> list[str]:
    """Apply the rewrite of the module doc in place; returns one note per scan rewritten."""
    notes = [_rewrite_one(gm, m) for m in match_heinsen_scans(gm, time_dims)]
    if notes:
        gm.graph.eliminate_dead_code()
    return notes
