"""Recognise an initial state folded into a scan's first input, and unfold it.

Vectorised scans have no ``h0`` argument, so users fold it into the first step::

    u' = cat([u[:, :1] + a[:, :1] * h0.unsqueeze(1), u[:, 1:]], 1);  h = scan(a, u')   # diagonal
    u' = cat([u[:, :1] + a[:, :1] @ h0.unsqueeze(1), u[:, 1:]], 1);  h = scan(A, u')   # dense

which is the same recurrence as ``h = scan(a, u, h0)`` (``h_1 = a_1 h0 + u_1``, the very
operations the fold performs). Left folded, the scan's input ``u'`` reads the first step of
``u`` and of ``a`` apart (slices of length 1 along time), so the adjoint region cannot pull
``u``'s producers in and keeps ``u`` itself -- N times the layer input -- for the backward.
:func:`match_folded_initial_state` finds the fold; :func:`emit_initial_state` builds ``h0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.passes.recurrence_graph import fake_run

aten = torch.ops.aten

__all__ = ["FoldedInitialState", "match_folded_initial_state", "emit_initial_state", "time_slice"]

_BROADCASTS = (aten.expand.default, aten.expand_as.default, aten.broadcast_to.default)


@dataclass(frozen=True)
class FoldedInitialState:
    """``u_folded = cat([u[first] + a[first] (*|@) carry, u[rest]])``: the unfolded ``u`` and the carry."""

    u: fx.Node
    carry: fx.Node  # h0 with a size-1 time dim (or broadcastable to the first step)


def _val(n: Any) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _arg(n: fx.Node, i: int, name: str, default: Any) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def time_slice(n: Any, rank: int, td: int) -> Optional[tuple[fx.Node, int, int]]:
    """``(src, start, end)`` when ``n = src[..., start:end, ...]`` along the (right-aligned) time dim ``td``."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or n.target is not aten.slice.Tensor:
        return None
    src = n.args[0]
    sv = _val(src)
    if sv is None or _arg(n, 4, "step", 1) != 1:
        return None
    d = _arg(n, 1, "dim", 0) % sv.dim()
    if d != td - (rank - sv.dim()):
        return None
    length = int(sv.shape[d])
    start = _arg(n, 2, "start", None)
    end = _arg(n, 3, "end", None)
    start = 0 if start is None else (start + length if start < 0 else min(start, length))
    end = length if end is None else (end + length if end < 0 else min(end, length))
    return src, start, end


def _base(n: Any) -> Any:
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _BROADCASTS:
        n = n.args[0]
    return n


_SAME_SHAPE_VIEWS = (aten.reshape.default, aten.view.default, aten.expand.default, aten._unsafe_view.default)


def _strip_noop_views(n: Any) -> Any:
    """``n`` without reshapes/expands that keep its shape (what a decomposed-then-restored
    ``matmul`` leaves around its operands)."""
    while (isinstance(n, fx.Node) and n.op == "call_function" and n.target in _SAME_SHAPE_VIEWS
           and isinstance(n.args[0], fx.Node) and _val(n) is not None and _val(n.args[0]) is not None
           and tuple(_val(n).shape) == tuple(_val(n.args[0]).shape)):
        n = n.args[0]
    return n


def _pairs(n: fx.Node) -> list[tuple[Any, Any]]:
    x, y = n.args[0], n.args[1]
    return [(x, y), (y, x)]


def _fits_first_step(carry: fx.Node, uv: torch.Tensor, td: int) -> bool:
    """Whether ``carry`` has ``u``'s dtype and broadcasts to ``u``'s first step (size 1 along time)."""
    cv = _val(carry)
    if cv is None or cv.dtype != uv.dtype or cv.dim() > uv.dim():
        return False
    first = [*uv.shape[:td], 1, *uv.shape[td + 1:]]
    try:
        return list(torch.broadcast_shapes(tuple(cv.shape), tuple(first))) == first
    except RuntimeError:
        return False


def match_folded_initial_state(u: fx.Node, a: Optional[fx.Node], td: int, kind: str) -> Optional[FoldedInitialState]:
    """The fold of the module doc in ``u`` (the scan's input, time at ``td``), or None.

    ``a``: the scan's decay node (None: ``a = 1``, where any additive term on the first step
    is an initial state). The decay's first step must be a slice of ``a`` itself or of another
    broadcast of the same tensor, so that ``a[first] * carry`` is exactly the scan's ``a_1 h0``.
    """
    uv = _val(u)
    if uv is None or u.op != "call_function" or u.target is not aten.cat.default:
        return None
    rank = uv.dim()
    pieces = u.args[0]
    if (_arg(u, 1, "dim", 0) % rank) != td or len(pieces) != 2 or int(uv.shape[td]) < 2:
        return None
    first, rest = pieces
    r = time_slice(rest, rank, td)
    if r is None or _val(r[0]) is None or _val(r[0]).dim() != rank or r[1:] != (1, int(uv.shape[td])):
        return None
    src = r[0]
    if tuple(_val(src).shape) != tuple(uv.shape) or _val(src).dtype != uv.dtype:
        return None
    if not isinstance(first, fx.Node) or first.target is not aten.add.Tensor or _arg(first, 2, "alpha", 1) != 1:
        return None
    for x, term in _pairs(first):
        if time_slice(x, rank, td) != (src, 0, 1) or not isinstance(term, fx.Node):
            continue
        if a is None:
            if _fits_first_step(term, uv, td):
                return FoldedInitialState(src, term)
            continue
        ops = (aten.mul.Tensor,) if kind == "diagonal" else (aten.matmul.default,)
        if term.op != "call_function" or term.target not in ops:
            continue
        for s, carry in (_pairs(term) if kind == "diagonal" else [(term.args[0], term.args[1])]):
            s, carry = _strip_noop_views(s), _strip_noop_views(carry)
            sl = time_slice(s, rank, td)
            if sl is None or sl[1:] != (0, 1) or _base(sl[0]) is not _base(a) or not isinstance(carry, fx.Node):
                continue
            if _fits_first_step(carry, uv, td):
                return FoldedInitialState(src, carry)
    return None


def emit_initial_state(graph: fx.Graph, fold: FoldedInitialState, u_shape: tuple[int, ...], td: int,
                       trace: Optional[str]) -> fx.Node:
    """``h0`` of shape ``u_shape`` without dim ``td``, from the fold's carry (inserted at the cursor)."""

    def emit(target, args) -> fx.Node:
        n = graph.call_function(target, args)
        n.meta["val"] = fake_run(target, args)
        if trace:
            n.meta["stack_trace"] = trace
        return n

    state = [*u_shape[:td], *u_shape[td + 1:]]
    c = fold.carry
    cv = _val(c)
    if (c.target is aten.unsqueeze.default and cv.dim() == len(u_shape) and c.args[1] % cv.dim() == td
            and list(_val(c.args[0]).shape) == state):
        return c.args[0]  # the usual spelling: h0.unsqueeze(1)
    first = [*u_shape[:td], 1, *u_shape[td + 1:]]
    full = c if list(cv.shape) == first else emit(aten.expand.default, (c, first))
    return emit(aten.select.int, (full, td, 0))
