"""Backend selection shared by every kernel in :mod:`gradshard.kernels`.

Two backends exist:

* ``"torch"``  -- the reference implementation in plain PyTorch ops (any device).
* ``"triton"`` -- the Triton kernels in :mod:`gradshard.kernels.triton`. They run on CUDA
  tensors, and on CPU tensors only under the Triton interpreter (``TRITON_INTERPRET=1`` set
  in the environment *before* the kernel modules are first imported).

``backend=None`` (or ``"auto"``) picks ``"triton"`` for CUDA tensors when Triton is
importable, and ``"torch"`` otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

import torch

BACKENDS: tuple[str, ...] = ("torch", "triton")


def triton_importable() -> bool:
    """True when the ``triton`` package can be imported."""
    return "triton" in sys.modules or importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """True when the Triton interpreter is requested through ``TRITON_INTERPRET=1``."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def available_backends() -> tuple[str, ...]:
    """Backends that can run here: always ``"torch"``; ``"triton"`` with CUDA or the interpreter."""
    if triton_importable() and (torch.cuda.is_available() or interpreter_enabled()):
        return BACKENDS
    return ("torch",)


def select_backend(tensor: torch.Tensor, backend: Optional[str]) -> str:
    """Resolve ``backend`` (None/"auto"/"torch"/"triton") for a kernel whose inputs live like ``tensor``.

    Raises ValueError for an unknown name and RuntimeError when Triton cannot run the request.
    """
    if backend is None or backend == "auto":
        return "triton" if tensor.is_cuda and triton_importable() else "torch"
    if backend not in BACKENDS:
        raise ValueError(
            f"gradshard.kernels: unknown backend {backend!r}; use one of {BACKENDS} or None (auto)."
        )
    if backend == "torch":
        return backend
    if not triton_importable():
        raise RuntimeError(
            "gradshard.kernels: backend='triton' was requested but the `triton` package is not "
            "installed; install triton or use backend='torch'."
        )
    if not tensor.is_cuda:
        if not interpreter_enabled():
            raise RuntimeError(
                f"gradshard.kernels: backend='triton' got a tensor on {tensor.device}; Triton kernels "
                "run on CPU tensors only under the Triton interpreter. Set TRITON_INTERPRET=1 in the "
                "environment before the process imports triton, move the tensors to CUDA, or use "
                "backend='torch'."
            )
        if tensor.device.type != "cpu":
            raise RuntimeError(
                f"gradshard.kernels: backend='triton' does not support device {tensor.device}; "
                "use CUDA tensors (or CPU under TRITON_INTERPRET=1) or backend='torch'."
            )
    return backend


def ensure_interpreter_consistent(module_interpreted: bool, tensor: torch.Tensor) -> None:
    """Fail clearly when a Triton kernel module was compiled for a different execution mode.

    Triton decides between the interpreter and the compiler when a ``@triton.jit`` function is
    defined, i.e. when :mod:`gradshard.kernels.triton` is first imported.
    """
    if not tensor.is_cuda and not module_interpreted:
        raise RuntimeError(
            "gradshard.kernels: the Triton kernels were imported without TRITON_INTERPRET=1, so they "
            f"cannot run on {tensor.device} tensors. Set TRITON_INTERPRET=1 before the first import "
            "of triton in this process, or use backend='torch'."
        )


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype every kernel accumulates in: float64 stays float64, everything else float32."""
    if not dtype.is_floating_point:
        raise TypeError(f"gradshard.kernels: expected a floating-point tensor, got dtype {dtype}.")
    return torch.float64 if dtype == torch.float64 else torch.float32


def runs_direct(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a kernel's front door may call its body directly instead of through its
    ``torch.ops.gradshard`` op, which costs ~50 us of Python dispatch per call (a shard's scan on
    CPU is ~11 us): only when nothing can observe the difference, i.e. no autograd on the inputs,
    plain tensors (no fake, functional or vmap-wrapped ones), no dispatch or function mode (fake
    propagation, ``FlopCounterMode``), no Dynamo trace and no profiler. The op is what those see."""
    if torch.compiler.is_compiling():  # first: Dynamo cannot trace the checks below
        return False
    if (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
            or torch._C._functorch.peek_interpreter_stack() is not None
            or torch.autograd.profiler._is_profiler_enabled):
        return False
    grad = torch.is_grad_enabled()
    return all(t is None or (type(t) is torch.Tensor and not (grad and t.requires_grad)) for t in tensors)
