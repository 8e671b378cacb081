"""Exactness checks for composed programs: a compiled module against plain autograd (float64)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

import gradshard as gs
from gradshard.compose import ComposedGraph

TOL = 1e-10


def _loss(out: Any) -> torch.Tensor:
    """A fixed non-uniform weighting of every floating output (tuples and HF outputs summed)."""
    if hasattr(out, "__dataclass_fields__"):
        out = tuple(getattr(out, f) for f in out.__dataclass_fields__)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    total = torch.zeros((), dtype=torch.float64)
    for o in outs:
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            w = torch.linspace(-1.0, 1.0, o.numel(), dtype=o.dtype).view_as(o)
            total = total + (o * w).sum() + 0.1 * (o ** 2).sum()
    return total


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    return ((a - b).norm() / max(b.norm().item(), floor, 1e-300)).item()


def _run(target: Any, args: tuple, params: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in params:
        p.grad = None
    ins = tuple(x.detach().clone().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point()
                else x for x in args)
    loss = _loss(target(*ins))
    loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    grads += [x.grad for x in ins if isinstance(x, torch.Tensor) and x.grad is not None]
    return loss.detach(), grads


def assert_exact(model: nn.Module | Callable[..., Any], args: tuple, plan: str, *,
                 compiler: Callable[..., Any] | None = None, model_arg: int | None = None,
                 **options: Any) -> gs.CompiledModule:
    """``gs.compile(model, plan, inductor=True)`` (segments compiled by ``compiler``, default
    Inductor) gives plain autograd's loss and gradients (parameters and float inputs)."""
    ref_args = copy.deepcopy(args)
    ref_model = copy.deepcopy(model) if isinstance(model, nn.Module) else model
    owner = args[model_arg] if model_arg is not None else model
    ref_owner = ref_args[model_arg] if model_arg is not None else ref_model
    cm = gs.compile(model, plan=plan, inductor=True, **options)
    cm.segment_compiler = compiler
    want_loss, want = _run(ref_model, ref_args, list(ref_owner.parameters()))
    got_loss, got = _run(cm, args, list(owner.parameters()))
    assert _rel(got_loss, want_loss) <= TOL
    total = torch.sqrt(sum(g.square().sum() for g in want)).item()
    assert total > 0 and len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        err = _rel(g, w, floor=1e-6 * total)
        assert err <= TOL, f"{plan}: gradient {i} differs: rel err {err:.3e}"
    return cm


def composed(cm: gs.CompiledModule) -> ComposedGraph:
    """The composition the last call ran."""
    c = cm.current.extras.get("inductor")
    assert isinstance(c, ComposedGraph) and c.source is cm.current.gm
    return c
