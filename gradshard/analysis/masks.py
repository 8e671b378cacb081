"""Is an attention mask causal? Read from its values when it is a constant, else from how it
is built (a padding mask from the call's input combined with a causal one).

A mask is read as its consumer reads it: ``add`` and SDPA float masks mask below -1e4 (or with
``-inf``); ``mul`` (decay masks of linear attention) with zeros; ``masked_fill`` masks where
True; ``where(cond, scores, -inf)`` and SDPA bool masks keep where True.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from .consts import evaluate_constant

__all__ = ["is_causal_mask"]

aten = torch.ops.aten


def is_causal_mask(op: Any, mask: fx.Node, known: dict[str, torch.Tensor] | None = None) -> bool:
    """Is ``mask`` causal as ``op`` reads it (module doc): every future entry masked? Read from its
    values when it is computed from constants (``known`` placeholders included), else from how it
    is built (:func:`_causal_by_structure`). Masking part of the past too (sliding windows) is
    still causal."""
    val = evaluate_constant(mask, known)
    if val is None:
        return _causal_by_structure(op, mask, known)
    if val.dim() < 2 or val.shape[-1] < 2:
        return False
    m = val.detach().reshape(-1, val.shape[-2], val.shape[-1])
    tq, tk = m.shape[-2:]
    future = torch.ones(tq, tk, dtype=torch.bool).triu(1 + tk - tq)
    if op in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        masked = m.bool()
    elif op is aten.mul.Tensor:  # multiplicative (decay) masks: zero in the future
        masked = m == 0
    elif m.dtype == torch.bool:  # where(cond, scores, -inf) / SDPA: True keeps
        masked = ~m
    else:
        masked = torch.isneginf(m) | (m < -1e4)
    return bool(masked[:, future].all())


#: Ops a mask passes through unchanged where its trailing (query, key) dims keep their sizes.
_MASK_PASS = {aten.expand.default, aten.clone.default, aten._to_copy.default, aten.to.dtype, aten.to.device,
              aten.alias.default, aten.contiguous.default}
_BOOL_AND = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default}
_BOOL_OR = {aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default}
_WHERE = {aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar}
#: comparisons with a constant that turn an additive float mask into a boolean one
_BELOW = {aten.lt.Scalar, aten.lt.Tensor, aten.le.Scalar, aten.le.Tensor}  # True where masked
_ABOVE = {aten.gt.Scalar, aten.gt.Tensor, aten.ge.Scalar, aten.ge.Tensor}  # True where kept
_MASKED = -1e4  # an additive mask's masked entries are below this (``is_causal_mask``)


def _constant(x: Any, known: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
    """``x`` (a number or a node computed from constants) as a tensor, else None."""
    if isinstance(x, (int, float)):
        return torch.tensor(float(x))
    return evaluate_constant(x, known) if isinstance(x, fx.Node) else None


def _all(x: Any, known: dict[str, torch.Tensor] | None, test: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    c = _constant(x, known)
    return c is not None and c.numel() > 0 and bool(test(c.double()).all())


def _same_trailing(a: Any, val: torch.Tensor) -> bool:
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[-2:]) == tuple(val.shape[-2:])


def _causal_by_structure(op: Any, mask: fx.Node, known: dict[str, torch.Tensor] | None) -> bool:
    """A mask that reads a graph input (a padding mask) is causal when it masks at least what a
    causal operand masks, seen through ops that keep the mask's trailing (query, key) sizes (a
    ``(1, S)`` row broadcast to ``(L, S)`` is not):

    - boolean: ``causal & other`` where True keeps (SDPA, ``where``), ``causal | other`` where
      True masks (``masked_fill``); ``f < c`` (True masks) and ``f > c`` (True keeps) of an
      additive causal ``f`` and a constant ``c >= -1e4``;
    - additive float (``add``, SDPA): ``masked_fill(x, causal, v)`` and ``where(keep, x, v)`` with
      a constant ``v < -1e4`` (falcon's ALiBi bias masked by the causal and padding mask).
    """
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return False
    t, args = mask.target, mask.args
    if t in _MASK_PASS and isinstance(args[0], fx.Node):  # a bool -> float cast is no mask's pass-through
        src = args[0].meta.get("val")
        return (_same_trailing(args[0], val) and (src.dtype == torch.bool) == (val.dtype == torch.bool)
                and is_causal_mask(op, args[0], known))
    masks_where_true = op in (aten.masked_fill.Scalar, aten.masked_fill.Tensor)
    if val.dtype == torch.bool:
        combine = _BOOL_OR if masks_where_true else _BOOL_AND
        if t in combine:
            return any(_same_trailing(a, val) and is_causal_mask(op, a, known) for a in args[:2])
        compare = _BELOW if masks_where_true else _ABOVE
        if t in compare and len(args) == 2 and _same_trailing(args[0], val):
            return (_all(args[1], known, lambda c: c >= _MASKED)
                    and is_causal_mask(aten.add.Tensor, args[0], known))
        return False
    if masks_where_true or op is aten.mul.Tensor or not val.is_floating_point():
        return False  # a float tensor read as a boolean, or a multiplicative (decay) mask
    below = lambda c: c < _MASKED  # noqa: E731
    if t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        return (_same_trailing(args[1], val) and _all(args[2], known, below)
                and is_causal_mask(aten.masked_fill.Scalar, args[1], known))
    if t in _WHERE:
        cond, a, b = args[:3]
        if not _same_trailing(cond, val):
            return False
        if _all(b, known, below):
            return is_causal_mask(aten.scaled_dot_product_attention.default, cond, known)
        if _all(a, known, below):
            return is_causal_mask(aten.masked_fill.Scalar, cond, known)
    return False
