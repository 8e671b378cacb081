"""Launch helpers shared by the Triton kernels: broadcast strides, dtypes, block sizes."""

from __future__ import annotations

import contextvars
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import triton
import triton.language as tl

from ..backend import ensure_interpreter_consistent, interpreter_enabled

#: Whether this process's @triton.jit functions were created in interpreter mode.
INTERPRETED: bool = interpreter_enabled()

# The Triton interpreter patches `triton.language` globally while a kernel runs, so two threads
# launching at once break each other ("Did you forget to add @triton.jit ?"). Threaded ranks
# (gradshard.distributed.testing) do exactly that; compiled launches need no lock. Reentrant:
# scan_triton calls itself for the chunk summaries.
_INTERPRETER_LOCK = threading.RLock()

#: True while :func:`gradshard.kernels.triton.aot.record_launches` intercepts launches: launchers
#: then run on CPU tensors without the interpreter and no kernel executes (ahead-of-time compiles).
RECORDING_LAUNCHES: contextvars.ContextVar[bool] = contextvars.ContextVar("gs_recording_launches", default=False)

F = TypeVar("F", bound=Callable[..., Any])


def serialized_launch(fn: F) -> F:
    """Run ``fn`` (a kernel launcher) under a process-wide lock in interpreter mode; as is when compiled."""
    if not INTERPRETED:
        return fn

    @functools.wraps(fn)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with _INTERPRETER_LOCK:
            return fn(*args, **kwargs)

    return locked  # type: ignore[return-value]


@dataclass(frozen=True)
class StateStrides:
    """How a (possibly broadcast) coefficient tensor is addressed by (batch, time, flat state index n).

    The flat index ``n`` of ``u``'s state splits as ``(n // inner, n % inner)``; the element
    lives at ``b * batch + t * time + (n // inner) * outer_stride + (n % inner) * inner_stride``.
    """

    tensor: torch.Tensor
    batch: int
    time: int
    inner: int
    outer_stride: int
    inner_stride: int


def _coalesce(sizes: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """Merge adjacent state dims that address memory as one; returns [(size, stride)] outer->inner."""
    groups: list[tuple[int, int]] = []
    for size, stride in reversed(list(zip(sizes, strides))):
        if size == 1:
            continue
        if groups and stride == groups[-1][1] * groups[-1][0]:
            g_size, g_stride = groups[-1]
            groups[-1] = (g_size * size, g_stride)
        else:
            groups.append((size, stride))
    return list(reversed(groups))


def state_strides(a: torch.Tensor, shape: torch.Size) -> StateStrides:
    """Strides of ``a`` broadcast to ``shape`` = (batch, time, *state), with the state flattened."""
    exp = a.expand(shape)
    groups = _coalesce(tuple(shape[2:]), tuple(exp.stride()[2:]))
    if len(groups) > 2:  # an unusual broadcast pattern: materialise it once
        exp = exp.contiguous()
        groups = _coalesce(tuple(shape[2:]), tuple(exp.stride()[2:]))
    if not groups:
        inner, outer_stride, inner_stride = 1, 0, 0
    elif len(groups) == 1:
        inner, outer_stride, inner_stride = groups[0][0], 0, groups[0][1]
    else:
        inner, outer_stride, inner_stride = groups[1][0], groups[0][1], groups[1][1]
    batch = exp.stride(0) if shape[0] > 1 else 0
    time = exp.stride(1) if shape[1] > 1 else 0
    return StateStrides(exp, batch, time, inner, outer_stride, inner_stride)


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """Triton dtype of an accumulation torch dtype."""
    return {torch.float32: tl.float32, torch.float64: tl.float64}[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact IEEE for float32/float64 inputs, tf32 for half inputs."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def check_device(*tensors: torch.Tensor) -> None:
    """Raise clearly if the kernels cannot run on these tensors in this process."""
    if RECORDING_LAUNCHES.get():
        return
    for t in tensors:
        ensure_interpreter_consistent(INTERPRETED, t)


def pow2(n: int, floor: int = 16) -> int:
    """Next power of two >= max(n, floor) (tl.dot needs every dim >= 16)."""
    return max(floor, triton.next_power_of_2(max(1, int(n))))
