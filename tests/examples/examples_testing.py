"""Comparison helpers shared by the example-model tests."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||``."""
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def assert_grads_close(
    names: list[str], grads: list[torch.Tensor], refs: list[torch.Tensor], tol: float
) -> None:
    """Per-parameter relative error; a structurally zero gradient (e.g. the query weights
    at T=1) is judged against 1e-3 of the total gradient norm instead of its own zero norm."""
    total = torch.sqrt(sum(r.square().sum() for r in refs)).item()
    assert total > 0, "every reference gradient is zero: the comparison would prove nothing"
    for name, g, r in zip(names, grads, refs):
        scale = max(r.norm().item(), 1e-3 * total)
        err = (g - r).norm().item()
        assert err <= tol * scale, f"{name}: |g - ref| = {err:.3e} > {tol:.0e} * {scale:.3e}"


def outputs_and_grads(model: torch.nn.Module, *args) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and the gradient of a fixed, non-uniform weighting of them for every parameter."""
    logits = model(*args)
    weights = torch.linspace(-1.0, 1.0, logits.numel(), dtype=logits.dtype).view_as(logits)
    grads = torch.autograd.grad((logits * weights).sum(), list(model.parameters()), materialize_grads=True)
    return logits.detach(), list(grads)


def compare_models(a: torch.nn.Module, b: torch.nn.Module, *args, tol: float) -> None:
    """Same outputs and same parameter gradients (parameters matched by position)."""
    out_a, grads_a = outputs_and_grads(a, *args)
    out_b, grads_b = outputs_and_grads(b, *args)
    assert torch.isfinite(out_a).all()
    assert rel_err(out_a, out_b) <= tol
    assert_grads_close([n for n, _ in b.named_parameters()], grads_a, grads_b, tol)


def require_kernel(name: str):
    """``gradshard.kernels.<name>`` (it ships with gradshard: a missing one fails the test)."""
    import gradshard.kernels as kernels

    return getattr(kernels, name)
