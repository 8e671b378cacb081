"""Shared checks for the adjoint tests: gradients of a compiled model vs plain autograd."""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from torch import nn

import gradshard as gs

from .models import weighted_loss

TOL = 1e-10


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    return ((a - b).norm() / max(b.norm().item(), floor, 1e-300)).item()


def grads_of(model: nn.Module, inputs: tuple, run: Optional[Callable] = None) -> tuple[Any, dict[str, torch.Tensor], list]:
    """Output, parameter gradients and input gradients of ``weighted_loss(run(*inputs))``."""
    model.zero_grad(set_to_none=True)
    ins = tuple(x.detach().clone().requires_grad_(x.dtype.is_floating_point) if isinstance(x, torch.Tensor) else x
                for x in inputs)
    out = (run or model)(*ins)
    weighted_loss(out).backward()
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    in_grads = [x.grad.clone() if isinstance(x, torch.Tensor) and x.grad is not None else None for x in ins]
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(o.detach() for o in outs), grads, in_grads


def assert_same_grads(model: nn.Module, inputs: tuple, *, plan: str = "adjoint", reference: Optional[nn.Module] = None,
                      tol: float = TOL, **options: Any) -> gs.CompiledModule:
    """Compile ``model`` with ``plan`` and compare outputs and every gradient with ``reference``."""
    ref_model = reference if reference is not None else copy.deepcopy(model)
    cm = gs.compile(model, plan=plan, **options)
    out, grads, in_grads = grads_of(model, inputs, cm)
    ref_out, ref_grads, ref_in = grads_of(ref_model, inputs)
    for o, r in zip(out, ref_out):
        assert rel_err(o, r) <= tol, f"output differs: {rel_err(o, r):.3e}"
    total = torch.sqrt(sum(g.square().sum() for g in ref_grads.values())).item()
    assert total > 0
    for name, r in ref_grads.items():
        err = rel_err(grads[name], r, floor=1e-6 * total)
        assert err <= tol, f"{plan}: grad of {name}: rel err {err:.3e}"
    for g, r in zip(in_grads, ref_in):
        if r is not None:
            assert g is not None, "no gradient reached the model input"
            err = rel_err(g, r)
            assert err <= tol, f"{plan}: input grad rel err {err:.3e}"
    return cm
