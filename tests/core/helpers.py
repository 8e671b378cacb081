"""Comparison helpers: a compiled run against eager PyTorch."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn


def loss_of(out: Any) -> torch.Tensor:
    """A scalar that depends on every floating output (weights break symmetries)."""
    if isinstance(out, torch.Tensor):
        if not out.is_floating_point():
            return torch.zeros(())
        w = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).reshape(out.shape)
        return (out * w).sum()
    if hasattr(out, "__dataclass_fields__"):
        return sum((loss_of(getattr(out, f)) for f in out.__dataclass_fields__ if getattr(out, f) is not None), torch.zeros(()))
    if isinstance(out, dict):
        return sum((loss_of(v) for v in out.values()), torch.zeros(()))
    if isinstance(out, (tuple, list)):
        return sum((loss_of(v) for v in out), torch.zeros(()))
    return torch.zeros(())


def flat_outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "__dataclass_fields__"):
        return [t for f in out.__dataclass_fields__ for t in flat_outputs(getattr(out, f))]
    if isinstance(out, dict):
        return [t for v in out.values() for t in flat_outputs(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in flat_outputs(v)]
    return []


def grads_of(modules: list[nn.Module], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    gs = [p.grad for m in modules for p in m.parameters()]
    gs += [x.grad for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    return [g if g is not None else torch.zeros(()) for g in gs]


def run_both(make_compiled: Callable[[Any], Any], target: Any, args: tuple) -> tuple[list, list, list, list]:
    """Run ``target(*args)`` eagerly and through gradshard; return outputs and gradients."""
    target2 = copy.deepcopy(target)
    args2 = copy.deepcopy(args)
    modules1 = [m for m in (target, *args) if isinstance(m, nn.Module)]
    modules2 = [m for m in (target2, *args2) if isinstance(m, nn.Module)]
    inputs1 = [a for a in args if isinstance(a, torch.Tensor)]
    inputs2 = [a for a in args2 if isinstance(a, torch.Tensor)]
    out1 = target(*args)
    loss_of(out1).backward()
    out2 = make_compiled(target2)(*args2)
    loss_of(out2).backward()
    return (flat_outputs(out1), flat_outputs(out2), grads_of(modules1, inputs1), grads_of(modules2, inputs2))


def assert_identical(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float = 0.0) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if rtol == 0.0:
            assert torch.equal(x, y), f"max abs diff {(x - y).abs().max().item()}"
        else:
            scale = x.abs().max().clamp_min(1e-300)
            assert ((x - y).abs().max() / scale).item() <= rtol
