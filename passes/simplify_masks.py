"""simplify_attention_masks: drop mask terms that are always true; a causal mask -> ``is_causal``.

A traced mask builder cannot look at values, so it keeps terms an eager call would have
dropped after looking. transformers, traced, cannot tell that the position ids hold one
sequence per row and ands a packed-sequence term into every causal mask::

    before:  seq = cumsum(diff(positions) != 1)                    # (B, T), all zeros
             mask = (kv <= q) & (seq[b, q] == seq[b, kv])          # (B, 1, T, T)
    after:   mask = (kv <= q)

A term is dropped when it is ``eq``/``le``/``ge`` of two gathers of one tensor that depends on
no graph input and holds a single value, or a constant ``True``; and only when the other
operand already has the result's shape. What is left is often the causal mask written as a
comparison of positions, which eager transformers would not have built at all::

    before:  sdpa(q, k, v, attn_mask=expand(pos[b, kv] <= pos[b, q]))
    after:   sdpa(q, k, v, is_causal=True)

when ``pos`` depends on no graph input and is strictly increasing along time (checked on
its ``(B, T)`` values). The chunked plans then run flash attention per chunk against the KV
cache instead of slicing a hoisted ``(T, T)`` mask.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from gradshard.analysis.consts import evaluate_constant
from gradshard.pipeline import PassContext, PassResult, graph_pass

from gradshard.passes.recurrence_graph import copy_graph_module

aten = torch.ops.aten

__all__ = ["simplify_attention_masks"]

_ANDS = (aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default, aten.mul.Tensor)
_REFLEXIVE = (aten.eq.Tensor, aten.le.Tensor, aten.ge.Tensor)
_SMALL = 1 << 22


def _small_constant(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.numel() > _SMALL:
        return None
    return evaluate_constant(node)


def _always_true(node: fx.Node) -> bool:
    """``node`` is True everywhere, whatever the graph inputs (see the module doc)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
        return False
    if node.target in _REFLEXIVE:
        a, b = node.args[:2]
        if (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.target is aten.index.Tensor
                and b.target is aten.index.Tensor and a.args[0] is b.args[0]):
            src = _small_constant(a.args[0])
            return src is not None and src.numel() > 0 and bool((src == src.reshape(-1)[0]).all())
        return False
    const = _small_constant(node)
    return const is not None and bool(const.all())


_SDPA = aten.scaled_dot_product_attention.default
_PASS_THROUGH = (aten.expand.default, aten.alias.default, aten.detach.default)


def _positions(a: fx.Node, b: fx.Node) -> bool:
    """``a`` (..., 1, T) and ``b`` (..., T, 1) hold the same strictly increasing positions."""
    av, bv = _small_constant(a), _small_constant(b)
    if av is None or bv is None or av.dim() < 2 or bv.dim() < 2 or av.shape[-2] != 1 or bv.shape[-1] != 1:
        return False
    kv, q = av.squeeze(-2), bv.squeeze(-1)
    if kv.shape != q.shape or kv.shape[-1] < 1 or kv.is_floating_point():
        return False
    return bool((kv == q).all()) and bool((kv.diff(dim=-1) > 0).all())


def _is_causal_mask(mask: fx.Node) -> bool:
    """``mask`` is a boolean ``pos[kv] <= pos[q]`` (or ``pos[q] >= pos[kv]``) over strictly
    increasing ``pos`` (a float mask is an additive bias, never folded)."""
    val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
        return False
    while isinstance(mask, fx.Node) and mask.op == "call_function" and mask.target in _PASS_THROUGH:
        mask = mask.args[0]
    if not isinstance(mask, fx.Node) or mask.op != "call_function":
        return False
    if mask.target is aten.le.Tensor:
        return _positions(mask.args[0], mask.args[1])
    if mask.target is aten.ge.Tensor:
        return _positions(mask.args[1], mask.args[0])
    return False


def _fold_causal_masks(new: fx.GraphModule) -> list[str]:
    notes = []
    for node in list(new.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        q, k = node.args[0].meta.get("val"), node.args[1].meta.get("val")
        if mask is None or causal or q is None or k is None or q.shape[-2] != k.shape[-2]:
            continue
        if not _is_causal_mask(mask):
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        kwargs.pop("attn_mask", None)
        if len(args) > 3:
            args[3] = None
        if len(args) > 5:
            args[5] = True
        else:
            kwargs["is_causal"] = True
        node.args, node.kwargs = tuple(args), kwargs
        notes.append(f"{node.name}: causal mask {mask.name} -> is_causal=True")
    return notes


@graph_pass
def simplify_attention_masks(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Drop always-true mask terms (``x & t`` -> ``x``), then turn a causal position mask into
    ``is_causal=True`` (see the module doc)."""
    new = copy_graph_module(gm)
    dropped: list[str] = []
    for node in list(new.graph.nodes):
        if node.op != "call_function" or node.target not in _ANDS:
            continue
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            continue
        a, b = node.args[:2]
        for keep, term in ((a, b), (b, a)):
            kv = keep.meta.get("val") if isinstance(keep, fx.Node) else None
            if (isinstance(kv, torch.Tensor) and kv.dtype == torch.bool and kv.shape == out.shape
                    and _always_true(term)):
                node.replace_all_uses_with(keep)
                dropped.append(f"{node.name}: dropped {term.name} (always true)")
                break
    dropped += _fold_causal_masks(new)
    if not dropped:
        return PassResult(gm, notes=("masks already simple",))
    new.graph.eliminate_dead_code()
    new.graph.lint()
    new.recompile()
    return PassResult(new, changed=True, notes=tuple(dropped))
