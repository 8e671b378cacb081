"""Side effects of nodes that decide whether a plan may recompute them."""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["draws_random_numbers"]

aten = torch.ops.aten
_DROPOUTS = (aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
             aten.feature_alpha_dropout.default)


def draws_random_numbers(node: fx.Node) -> bool:
    """Whether ``node`` consumes the random stream (an op tagged ``nondeterministic_seeded``),
    so a recompute of it in backward would draw different numbers than the forward did.
    Dropout with ``p == 0`` or ``train=False`` draws nothing."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if target in _DROPOUTS:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return bool(p) and bool(train)
    return True
