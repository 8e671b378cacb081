"""Helpers for the chunked-plan tests: gradients of a model/loss and their relative error."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def rel_err(ref: Sequence[torch.Tensor | None], got: Sequence[torch.Tensor | None]) -> float:
    """||ref - got|| / ||ref|| over all tensors (None counts as zeros)."""
    num = den = 0.0
    for a, b in zip(ref, got):
        a = torch.zeros(()) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        num += float(((a - b) ** 2).sum())
        den += float((a**2).sum())
    return (num / den) ** 0.5 if den else num**0.5


def grads(out: torch.Tensor, wrt: Sequence[torch.Tensor], cot: torch.Tensor | None = None) -> list[torch.Tensor | None]:
    """d(out . cot)/d(wrt) (cot=None: out is a scalar loss)."""
    return list(torch.autograd.grad(out, list(wrt), cot, allow_unused=True))


def seeded(fn: Callable[[], torch.nn.Module], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return fn().double()
