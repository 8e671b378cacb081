"""Chunk rule for triangular solves: ``linalg_solve_triangular(A, B, upper, left, unitriangular)``.

``X = A^{-1} B`` with ``A`` triangular over its last two dims. Two time situations:

- time runs only along batch dims (neither of ``A``'s matrix dims, nor ``B``'s row dim): each
  step solves its own system, so the op is local (the window of the output is the window
  of every input);
- time runs along the solve itself: ``A``'s rows and columns are the query and key steps of
  a score-like matrix and ``B``'s rows are steps. For a *lower* triangular ``A`` solved from
  the left, row ``t`` of ``X`` reads rows ``<= t`` of ``A`` and ``B`` (forward substitution),
  so rows ``[s, e)`` of ``X`` are rows ``[s, e)`` of ``solve(A[:e, :e], B[:e])``: a causal mixer
  whose inputs are read on the prefix ``[0, e)``. An upper triangular ``A`` (back
  substitution) or a solve from the right reads later steps: refused naming the node.

Before/after for a chunk of steps ``[s, e)`` (time on the rows)::

    x = linalg_solve_triangular(a, b, upper=False)          # a: (.., T, T), b: (.., T, n)
    x_chunk = linalg_solve_triangular(a[.., :e, :e], b[.., :e, :], upper=False)[.., s:e, :]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from gradshard.errors import node_error
from gradshard.plans.chunked.frames import Demand, DimMap
from gradshard.plans.chunked.rules import (BuildCtx, NodeRule, _arg, _INSTEAD, meta_shape, positional,
                                           register_chunk_rule)
from gradshard.plans.chunked.rules_local import _broadcast_mapper

aten = torch.ops.aten

__all__ = ["solve_triangular_rule"]


def _solve_prefix_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    """Solve on the prefix ``[0, e)`` and keep the output window's rows ``[s, e)``."""
    a, b = vals
    (lo, hi), = demand
    x = aten.linalg_solve_triangular.default(a, b, upper=False, left=True,
                                             unitriangular=bool(_arg(node, 4, "unitriangular", False)))
    first = arg_demands[1][0][0]  # the prefix B was read on starts here (0)
    return x.narrow(x.dim() - 2, lo - first, hi - lo)


@register_chunk_rule(aten.linalg_solve_triangular)
def solve_triangular_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """Local when time is a batch dim; a causal prefix mixer for a lower solve along time."""
    a, b = node.args[0], node.args[1]
    fa, fb = bc.frame(a), bc.frame(b)
    na, nb = len(meta_shape(a)), len(meta_shape(b))
    upper = bool(_arg(node, 2, "upper"))
    left = bool(_arg(node, 3, "left", True))
    along_a = [t for t in fa if t.dim >= na - 2]
    along_b = [t for t in fb if t.dim >= nb - 2]
    if not along_a and not along_b:
        return positional(node, bc, _broadcast_mapper(node))
    where = "solves along the time axis"
    if upper or not left:
        raise node_error(node, f"a triangular solve that {where} with an upper triangular matrix or from "
                         "the right reads later steps (back substitution)", _INSTEAD)
    if (len(fa) != 2 or [t.dim for t in fa] != [na - 2, na - 1] or len(fb) != 1 or fb[0].dim != nb - 2
            or fa[0].length != fa[1].length or fa[0].length != fb[0].length
            or any(t.inner != 1 for t in (*fa, *fb))):
        raise node_error(node, f"a triangular solve that {where} must have the matrix's rows and columns and "
                         "the right-hand side's rows on time (and time nowhere else)", _INSTEAD)
    info = bc.tl.info.get(node.name)
    if info is None or info.reach is None or info.reach.hi > 0:
        raise node_error(node, f"a triangular solve that {where} reads later steps", _INSTEAD)
    frame = (fb[0],)
    prefix = DimMap("prefix", 0)
    return NodeRule(frame, ((prefix, prefix), (prefix,)), _solve_prefix_run, kind="mixer",
                    note="lower triangular solve along time: forward substitution over the prefix")
