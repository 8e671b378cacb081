"""Run a model with plan="lasp" on threaded gloo ranks and compare with one process."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

import gradshard as gs
from gradshard.distributed.testing import run_threaded
from gradshard.plans.lasp.runtime import local_slice


@dataclass
class Comparison:
    out_err: float  # max |o - o_ref| / max |o_ref| over the gathered slices
    grad_err: float  # worst relative gradient error over parameters and ranks
    results: list[Any]  # per rank: (output slice, grads, compiled module, extra)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float(a.norm())


def compare_lasp(model: nn.Module, ids: torch.Tensor, world: int, *, seed: int = 0,
                 extra: Callable[[int, Any, Any], Any] | None = None, **options: Any) -> Comparison:
    """Loss ``sum(logits * W)`` (fixed random ``W``): single process on the whole sequence vs
    ``world`` ranks each calling the compiled model on its slice; returns the errors."""
    ref = copy.deepcopy(model)
    out = ref(ids)
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    (out * weight).sum().backward()

    def body(rank: int, group: Any) -> Any:
        m = copy.deepcopy(model)
        cm = gs.compile(m, plan="lasp", group=group, **options)
        o = cm(local_slice(ids, rank, world))
        (o * local_slice(weight, rank, world)).sum().backward()
        grads = {n: p.grad for n, p in m.named_parameters()}
        return o.detach(), grads, cm, extra(rank, group, cm) if extra else None

    results = run_threaded(world, body, timeout_s=120.0)
    gathered = torch.cat([r[0] for r in results], dim=1)
    out = out.detach()
    out_err = float((gathered - out).abs().max() / out.abs().max())
    grad_err = 0.0
    for _, grads, _, _ in results:
        for name, p in ref.named_parameters():
            g = grads[name]
            if p.grad is None:
                assert g is None or not g.any(), f"{name}: gradient on a rank but not in the reference"
                continue
            grad_err = max(grad_err, _rel(g, p.grad))
    return Comparison(out_err, grad_err, results)
