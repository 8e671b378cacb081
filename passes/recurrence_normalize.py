"""Undo decomposed matmuls that merge the batch and time axes (``view -> mm -> view``).

Some captures decompose ``linear``/``einsum`` into ``view(x, [B*T, K]) -> addmm -> view(.., [B, T, N])``
(e.g. when ``associative_scan`` is traced). Splitting a merged ``B*T`` dim back gives both
halves the labels of both axes in the dims analysis, which then cannot tell batch from
time. These rewrites restore the unmerged ops (same values)::

    view(addmm(b, view(x, [B*T, K]), t(W)), [B, T, N])   ->  linear(x, W, b)
    view(mm(view(x, [B*T, K]), w), [B, T, N])             ->  matmul(x, w)
    view(bmm(view(x, [B*T, m, k]), view(y, [B*T, k, n])), [B, T, m, n])
                                                          ->  matmul(reshape(x, [B, T, m, k]), reshape(y, [B, T, k, n]))
    view(mm(W, t(view(x, [B*T, K]))), [N, B, T])          ->  permute(linear(x, W), [2, 0, 1])
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from gradshard.passes.recurrence_graph import fake_run

aten = torch.ops.aten

__all__ = ["unmerge_matmuls"]

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _shape(n: fx.Node) -> tuple[int, ...]:
    return tuple(n.meta["val"].shape)


def _view_src(n: object, rank: int) -> fx.Node | None:
    """The tensor ``n`` flattens (``n = view(src, [prod(lead), *rest])`` with ``rank`` dims)."""
    if not isinstance(n, fx.Node) or n.target not in _VIEWS:
        return None
    src = n.args[0]
    if not isinstance(src, fx.Node) or len(_shape(n)) != rank:
        return None
    return src


def _is_transpose(n: object) -> bool:
    """``n`` swaps the two dims of a matrix (``t``, ``transpose(0, 1)``, ``permute([1, 0])``)."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or len(_shape(n) or ()) != 2:
        return False
    if n.target is aten.t.default:
        return True
    if n.target is aten.transpose.int:
        return {n.args[1] % 2, n.args[2] % 2} == {0, 1}
    return n.target is aten.permute.default and list(n.args[1]) == [1, 0]


def _emit(graph: fx.Graph, target, args, like: fx.Node) -> fx.Node:
    n = graph.call_function(target, args)
    n.meta["val"] = fake_run(target, args)
    for k in ("stack_trace", "nn_module_stack"):
        if k in like.meta:
            n.meta[k] = like.meta[k]
    return n


def unmerge_matmuls(gm: fx.GraphModule) -> int:
    """Apply the rewrites of the module doc in place; returns how many were made."""
    graph = gm.graph
    count = 0
    for out in list(graph.nodes):
        if out.op != "call_function" or out.target not in _VIEWS or not isinstance(out.args[0], fx.Node):
            continue
        mm = out.args[0]
        lead = _shape(out)
        if mm.target in (aten.addmm.default, aten.mm.default) and len(lead) >= 3:
            x2 = mm.args[1] if mm.target is aten.addmm.default else mm.args[0]
            w = mm.args[2] if mm.target is aten.addmm.default else mm.args[1]
            src = _view_src(x2, 2)
            if src is None or len(mm.users) != 1:
                continue
            lead_out, n_out = lead[:-1], lead[-1]
            if tuple(_shape(src)[:-1]) != tuple(lead_out) or math.prod(lead_out) != _shape(x2)[0]:
                continue
            with graph.inserting_before(out):
                if isinstance(w, fx.Node) and w.target is aten.t.default:
                    bias = mm.args[0] if mm.target is aten.addmm.default else None
                    if bias is not None and len(_shape(bias)) != 1:
                        continue
                    new = _emit(graph, aten.linear.default, (src, w.args[0], bias), out)
                else:
                    new = _emit(graph, aten.matmul.default, (src, w), out)
                    if mm.target is aten.addmm.default:
                        new = _emit(graph, aten.add.Tensor, (new, mm.args[0]), out)
            if _shape(new) != lead:
                graph.erase_node(new)
                continue
            out.replace_all_uses_with(new)
            count += 1
        elif (mm.target in (aten.mm.default, aten.matmul.default) and len(lead) >= 3 and len(mm.users) == 1
              and len(_shape(mm)) == 2 and _is_transpose(mm.args[1])):
            # W @ view(x, [B*T, K]).t() viewed as [N, B, T] (mamba_simple's in_proj)
            w, src = mm.args[0], _view_src(mm.args[1].args[0], 2)
            if src is None or not isinstance(w, fx.Node) or len(_shape(w)) != 2:
                continue
            rows = lead[1:]
            if tuple(_shape(src)[:-1]) != tuple(rows) or math.prod(rows) != _shape(mm)[1]:
                continue
            with graph.inserting_before(out):
                lin = _emit(graph, aten.linear.default, (src, w, None), out)
                new = _emit(graph, aten.permute.default, (lin, [len(rows), *range(len(rows))]), out)
            if _shape(new) != lead:
                graph.erase_node(new)
                graph.erase_node(lin)
                continue
            out.replace_all_uses_with(new)
            count += 1
        elif mm.target is aten.bmm.default and len(lead) >= 4 and len(mm.users) == 1:
            x3, y3 = mm.args[0], mm.args[1]
            xs, ys = _view_src(x3, 3), _view_src(y3, 3)
            if xs is None or ys is None:
                continue
            batch = lead[:-2]
            if math.prod(batch) != _shape(mm)[0]:
                continue
            with graph.inserting_before(out):
                xr = _emit(graph, aten.reshape.default, (xs, [*batch, *_shape(x3)[1:]]), out)
                yr = _emit(graph, aten.reshape.default, (ys, [*batch, *_shape(y3)[1:]]), out)
                new = _emit(graph, aten.matmul.default, (xr, yr), out)
            out.replace_all_uses_with(new)
            count += 1
    if count:
        graph.eliminate_dead_code()
    return count
