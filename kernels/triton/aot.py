"""Compile gradshard's Triton kernels for a CUDA architecture on a machine without a GPU.

Two steps, each usable alone:

1. :func:`record_launches` runs kernel *launchers* (``scan_triton``, ``lightning_fwd_triton``, ...)
   on CPU tensors with every ``@triton.jit`` launch intercepted: the launcher computes its grid,
   strides, block sizes and constexprs exactly as it would on a GPU, nothing executes, and each
   launch is kept as a :class:`RecordedLaunch`.
2. :func:`compile_launch` compiles one recorded launch for ``sm_<arch>`` through Triton's own
   specialization and compiler pipeline (TTIR -> TTGIR -> LLVM IR -> PTX -> cubin with the bundled
   ``ptxas``) and reads the cubin's resource usage with the bundled ``cuobjdump``.

What this checks that the interpreter cannot: that every kernel variant the launchers produce
compiles for the GPU, and how many registers, how much shared memory and how much spill (local
memory) each needs -- hence the theoretical occupancy. What it cannot check: timing and numerics
on the device (``bench/bench_kernels.py`` on a GPU does that).

The process must import the kernels *without* ``TRITON_INTERPRET=1`` (then they are
``JITFunction`` objects, not interpreted functions).
"""

from __future__ import annotations

import contextlib
import math
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import triton
from triton.runtime.jit import JITFunction

from .layout import INTERPRETED, RECORDING_LAUNCHES

#: Per-SM limits used for the theoretical occupancy (CUDA occupancy calculator values), and the
#: most shared memory one block may opt into (``shared_per_block``; a launch above it fails).
SM_LIMITS: dict[int, dict[str, int]] = {
    80: dict(registers=65536, shared=167936, shared_per_block=166912, warps=64, blocks=32),
    86: dict(registers=65536, shared=102400, shared_per_block=101376, warps=48, blocks=16),
    89: dict(registers=65536, shared=102400, shared_per_block=101376, warps=48, blocks=24),
    90: dict(registers=65536, shared=233472, shared_per_block=232448, warps=64, blocks=32),
}


@dataclass(frozen=True)
class RecordedLaunch:
    """One intercepted ``kernel[grid](*args, **kwargs)`` call."""

    kernel: JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grid: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.kernel.__name__

    @property
    def constexprs(self) -> dict[str, Any]:
        """The launch's compile-time parameters (block sizes, flags, dtypes) by name."""
        names = [p.name for p in self.kernel.params]
        bound = dict(zip(names, self.args))
        bound.update(self.kwargs)
        return {p.name: bound[p.name] for p in self.kernel.params if p.is_constexpr and p.name in bound}

    def variant(self) -> str:
        """``name[K=V, ...]``: the kernel and its constexprs (what selects one compiled binary)."""
        parts = ", ".join(f"{k}={_short(v)}" for k, v in self.constexprs.items())
        return f"{self.name}[{parts}]"


@dataclass(frozen=True)
class CompiledVariant:
    """Resource usage of one launch compiled for ``sm_<arch>``."""

    variant: str
    arch: int
    grid: tuple[int, ...]
    num_warps: int
    registers: int
    shared_bytes: int
    spill_bytes: int  # local memory + stack: register spills (and any per-thread arrays)
    ptx_lines: int

    @property
    def occupancy(self) -> float:
        """Theoretical fraction of the SM's warp slots in use (registers, shared memory, warps)."""
        lim = SM_LIMITS.get(self.arch, SM_LIMITS[90])
        regs_per_warp = math.ceil(max(self.registers, 1) * 32 / 256) * 256
        by_regs = lim["registers"] // (regs_per_warp * self.num_warps)
        by_shared = lim["shared"] // self.shared_bytes if self.shared_bytes else lim["blocks"]
        blocks = min(by_regs, by_shared, lim["warps"] // self.num_warps, lim["blocks"])
        return blocks * self.num_warps / lim["warps"]


@contextlib.contextmanager
def record_launches() -> Iterator[list[RecordedLaunch]]:
    """Intercept every Triton launch in the block; yields the list the launches are appended to.

    Kernel outputs stay uninitialised (nothing runs), so launchers that feed one launch's output
    into the next (the chunked scan) still record every launch but compute garbage values.
    """
    if INTERPRETED:
        raise RuntimeError(
            "gradshard.kernels.triton.aot: the kernels were imported under TRITON_INTERPRET=1, so they "
            "are interpreted functions and cannot be compiled; run this in a process without it."
        )
    launches: list[RecordedLaunch] = []
    original = JITFunction.run

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        if callable(grid):
            raise NotImplementedError(f"{self.__name__}: callable grids are not recorded")
        launches.append(RecordedLaunch(self, tuple(args), dict(kwargs), tuple(int(g) for g in grid)))
        return None

    token = RECORDING_LAUNCHES.set(True)
    JITFunction.run = record  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
        RECORDING_LAUNCHES.reset(token)


def compile_launch(launch: RecordedLaunch, arch: int = 90) -> CompiledVariant:
    """Compile ``launch`` for ``sm_<arch>`` the way ``JITFunction.run`` would on that GPU."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    usage = read_resource_usage(compiled.asm["cubin"])
    return CompiledVariant(
        variant=launch.variant(),
        arch=arch,
        grid=launch.grid,
        num_warps=int(compiled.metadata.num_warps),
        registers=usage["REG"],
        shared_bytes=max(usage["SHARED"], int(compiled.metadata.shared)),
        spill_bytes=usage["LOCAL"] + usage.get("STACK", 0),
        ptx_lines=compiled.asm["ptx"].count("\n"),
    )


def read_resource_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump -res-usage`` of a single-kernel cubin as ``{"REG": ..., "SHARED": ..., "LOCAL": ...}``."""
    tool = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on a compiled kernel: {out.stderr.strip()}")
    usage = {key: int(val) for key, val in re.findall(r"\b(REG|SHARED|LOCAL|STACK):(\d+)", out.stdout)}
    missing = {"REG", "SHARED", "LOCAL"} - usage.keys()
    if missing:
        raise RuntimeError(f"cuobjdump printed no {sorted(missing)} for the kernel:\n{out.stdout}")
    return usage


def compile_all(launchers: dict[str, Callable[[], Any]], archs: tuple[int, ...] = (90,)) -> list[tuple[str, CompiledVariant]]:
    """Record each launcher's launches and compile the distinct variants; returns (case, result) rows."""
    rows: list[tuple[str, CompiledVariant]] = []
    seen: set[tuple[str, int]] = set()
    for case, launcher in launchers.items():
        with record_launches() as launches:
            launcher()
        if not launches:
            raise RuntimeError(f"{case}: the launcher recorded no Triton launch")
        for launch in launches:
            for arch in archs:
                key = (launch.variant() + repr(_signature_key(launch)), arch)
                if key in seen:
                    continue
                seen.add(key)
                rows.append((case, compile_launch(launch, arch)))
    return rows


def _signature_key(launch: RecordedLaunch) -> tuple[Any, ...]:
    """Dtypes of the tensor arguments (they select a binary as much as the constexprs do)."""
    return tuple(str(a.dtype) for a in launch.args if isinstance(a, torch.Tensor))


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    text = str(value)
    return text.removeprefix("fp").replace("triton.language.", "")
