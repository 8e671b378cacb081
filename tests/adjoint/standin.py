"""Stand-in third-party packages for the kernel-substitution tests.

mamba_ssm needs CUDA and does not install here. These helpers install a stand-in for one of its
modules, whose kernels behave like fused GPU kernels where it matters for capture: they read raw
storage (``data_ptr``), so no tracer can follow them, and they bring their own backward.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Callable, Iterator

import torch


class OpaqueKernel(torch.autograd.Function):
    """``fn(*tensors)`` as a fused kernel: real storage only, backward by recomputation."""

    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], *tensors: Any) -> torch.Tensor:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t.data_ptr()  # a CUDA/Triton kernel reads raw pointers: fails on fake tensors
        ctx.fn = fn
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return fn(*tensors)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs = [t.detach().requires_grad_(t.dtype.is_floating_point) if t is not None else None
                  for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
            live = [t for t in inputs if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(out, live, grad))
        return (None, *[next(grads) if t is not None and t.requires_grad else None for t in inputs])


@contextlib.contextmanager
def standin_package(module: str, kernels: dict[str, Callable[..., Any]], user_code: str,
                    user_module: str) -> Iterator[types.ModuleType]:
    """Install ``module`` (and its parent packages) holding ``kernels``, then import ``user_code``
    as ``user_module`` (it imports the kernels by name); restore ``sys.modules`` afterwards."""
    parts = module.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))] + [user_module]
    saved = {n: sys.modules.get(n) for n in names}
    mods = [types.ModuleType(n) for n in names[:-1]]
    for parent, child, part in zip(mods, mods[1:], parts[1:]):
        setattr(parent, part, child)
    for key, fn in kernels.items():
        setattr(mods[-1], key, fn)
    sys.modules.update(zip(names[:-1], mods))
    user = types.ModuleType(user_module)
    sys.modules[user_module] = user
    try:
        exec(compile(user_code, f"{user_module}.py", "exec"), user.__dict__)
        yield user
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
