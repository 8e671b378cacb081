"""Compile every Triton kernel variant for sm_80 / sm_90 on a machine without a GPU.

The launchers run at the shapes the benchmarks use (T = 16K, Mamba-sized states, lightning
heads of 64 and 128) with launches intercepted (:mod:`gradshard.kernels.triton.aot`); each
distinct variant is compiled to a cubin and its registers, shared memory, spills and
theoretical occupancy are reported. No timing: that needs a GPU (``bench_kernels.py``).

    python bench/bench_kernel_compile.py              # table
    python bench/bench_kernel_compile.py --results    # also write the section in bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("bench_kernel_compile: unset TRITON_INTERPRET (it compiles the kernels, it does not interpret them)")

import torch
import triton

from gradshard.kernels.triton.adjoint import adjoint_shard_triton
from gradshard.kernels.triton.aot import SM_LIMITS, CompiledVariant, compile_all
from gradshard.kernels.triton.lightning import lightning_bwd_triton, lightning_fwd_triton
from gradshard.kernels.triton.scan import Tiles, scan_triton

T = 16384


def _e(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uninitialised CPU tensor: the launches are recorded, never run, so values do not matter."""
    return torch.empty(shape, dtype=dtype)


def scan_cases() -> dict[str, Callable[[], Any]]:
    """linear_scan's forward and adjoint (reverse) launches: Mamba-style full ``a``, per-head ``a``."""
    b, d, n = 4, 1024, 16
    cases: dict[str, Callable[[], Any]] = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        name = str(dt).removeprefix("torch.")
        cases[f"scan fwd {name} B{b} T16K state {d}x{n}"] = lambda dt=dt: scan_triton(
            _e(b, T, d, n, dtype=dt), _e(b, T, d, n, dtype=dt), None)
        cases[f"scan rev+h0 {name} B{b} T16K state {d}x{n}"] = lambda dt=dt: scan_triton(
            _e(b, T, d, n, dtype=dt), _e(b, T, d, n, dtype=dt), _e(b, d, n, dtype=dt), reverse=True)
    cases["scan fwd fp32 per-head a (B,T,H,1,1), state 8x64x64"] = lambda: scan_triton(
        _e(2, T, 8, 1, 1), _e(2, T, 8, 64, 64), None)
    cases["scan chunked fp32 B1 T16K N64 (3 launches + recursion)"] = lambda: scan_triton(
        _e(1, T, 64), _e(1, T, 64), _e(1, 64), chunk=512)
    for dt, bn in ((torch.float32, 64), (torch.bfloat16, 32)):  # the policy's look-back tiles on a GPU
        name = str(dt).removeprefix("torch.")
        cases[f"scan look-back {name} B1 T64K N2048"] = lambda dt=dt, bn=bn: scan_triton(
            _e(1, 4 * T, 2048, dtype=dt), _e(1, 4 * T, 2048, dtype=dt), None, tiles=Tiles(64, bn, 2, lookback=True))
    return cases


def lightning_cases() -> dict[str, Callable[[], Any]]:
    """lightning_attention forward and backward, per-head decay and per-step gates, states in/out."""
    b, h = 2, 8
    cases: dict[str, Callable[[], Any]] = {}
    for d in (64, 128):
        for dt in (torch.float32, torch.bfloat16):
            name = str(dt).removeprefix("torch.")
            q = lambda d=d, dt=dt: _e(b, h, T, d, dtype=dt)  # noqa: E731
            decay = _e(h).view(1, h, 1).expand(b, h, T)
            cases[f"lightning fwd {name} d{d} decay+state"] = lambda q=q, d=d, decay=decay, dt=dt: lightning_fwd_triton(
                q(), q(), q(), decay, _e(b, h, d, d), 64, dt, torch.float32)
            cases[f"lightning bwd {name} d{d} decay+state"] = lambda q=q, d=d, decay=decay: lightning_bwd_triton(
                q(), q(), q(), decay, _e(b, h, d, d), q(), _e(b, h, d, d), 64, torch.float32)
            cases[f"lightning fwd {name} d{d} no decay"] = lambda q=q, dt=dt: lightning_fwd_triton(
                q(), q(), q(), None, None, 64, dt, torch.float32)
            cases[f"lightning bwd {name} d{d} no decay"] = lambda q=q: lightning_bwd_triton(
                q(), q(), q(), None, None, q(), None, 64, torch.float32)
    cases["lightning fwd+bwd fp32 d64 per-step gates (B,H,T)"] = lambda: (
        lightning_fwd_triton(_e(b, h, T, 64), _e(b, h, T, 64), _e(b, h, T, 64), _e(b, h, T), None, 64,
                             torch.float32, torch.float32),
        lightning_bwd_triton(_e(b, h, T, 64), _e(b, h, T, 64), _e(b, h, T, 64), _e(b, h, T), None,
                             _e(b, h, T, 64), None, 64, torch.float32))
    cases["lightning fwd+bwd fp64 d64 decay"] = lambda: (
        lightning_fwd_triton(*(_e(b, h, 1024, 64, dtype=torch.float64),) * 3, _e(b, h, 1024, dtype=torch.float64),
                             None, 64, torch.float64, torch.float64),
        lightning_bwd_triton(*(_e(b, h, 1024, 64, dtype=torch.float64),) * 3, _e(b, h, 1024, dtype=torch.float64),
                             None, _e(b, h, 1024, 64, dtype=torch.float64), None, 64, torch.float64))
    return cases


def adjoint_cases() -> dict[str, Callable[[], Any]]:
    """The fused adjoint shard (recompute from a checkpoint + VJP), a 2K-step shard of a Mamba state."""
    b, s, d, n = 4, 2048, 1024, 16
    cases: dict[str, Callable[[], Any]] = {}
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        name = str(dt).removeprefix("torch.")
        cases[f"adjoint shard {name} S2K state {d}x{n}, h0 + carry"] = lambda dt=dt: adjoint_shard_triton(
            _e(b, s, d, n, dtype=dt), _e(b, s, d, n, dtype=dt), _e(b, s, d, n, dtype=dt), _e(b, d, n, dtype=dt),
            _e(b, d, n, dtype=dt), out_dtypes=(dt, dt, dt))
    return cases


def all_cases() -> dict[str, Callable[[], Any]]:
    return {**scan_cases(), **lightning_cases(), **adjoint_cases()}


def render(rows: list[tuple[str, CompiledVariant]]) -> list[str]:
    """Markdown table: one row per (case, variant), one column group per architecture."""
    archs = sorted({r.arch for _, r in rows}, reverse=True)
    by_key: dict[tuple[str, str], dict[int, CompiledVariant]] = {}
    for case, r in rows:
        by_key.setdefault((case, r.variant), {})[r.arch] = r
    head = "| case | kernel variant | grid | warps | " + " | ".join(
        f"sm_{a} regs / shared / spill / occupancy" for a in archs) + " |"
    lines = [head, "|" + "---|" * (4 + len(archs))]
    for (case, variant), per_arch in by_key.items():
        first = next(iter(per_arch.values()))
        cells = [
            f"{r.registers} / {r.shared_bytes / 1024:.0f} KiB / {r.spill_bytes} B / {r.occupancy:.0%}"
            if (r := per_arch.get(a)) else "" for a in archs
        ]
        lines.append(f"| {case} | `{variant}` | {'x'.join(map(str, first.grid))} | {first.num_warps} | "
                     + " | ".join(cells) + " |")
    return lines


def summarize(rows: list[tuple[str, CompiledVariant]]) -> list[str]:
    """Per architecture: the largest shared memory and spill against the SM's limit."""
    out = []
    for arch in sorted({r.arch for _, r in rows}, reverse=True):
        mine = [r for _, r in rows if r.arch == arch]
        worst_shared = max(mine, key=lambda r: r.shared_bytes)
        worst_spill = max(mine, key=lambda r: r.spill_bytes)
        limit = SM_LIMITS[arch]["shared_per_block"]
        out.append(
            f"- sm_{arch}: {len(mine)} variants compiled; largest shared memory {worst_shared.shared_bytes / 1024:.0f} KiB "
            f"(`{worst_shared.variant.split('[')[0]}`; the SM allows {limit / 1024:.0f} KiB per block"
            f"{', EXCEEDED' if worst_shared.shared_bytes > limit else ''}); "
            f"{sum(1 for r in mine if r.spill_bytes)} spill, worst {worst_spill.spill_bytes} B per thread "
            f"(`{worst_spill.variant.split('[')[0]}`)."
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (90 = H100)")
    parser.add_argument("--results", action="store_true", help="write the section in RESULTS.md")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = compile_all(all_cases(), tuple(args.arch))
    lines = render(rows)
    summary = summarize(rows)
    print("\n".join(lines + [""] + summary))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.results:
        from results_md import write_subsection

        body = [
            f"Every Triton kernel variant the launchers produce at T = 16K (Mamba-sized scans, lightning "
            f"heads of 64 and 128, float32/bfloat16/float16/float64), compiled to cubins on a CPU-only machine "
            f"({platform.processor() or platform.machine()}) with triton {triton.__version__}'s bundled ptxas; "
            f"registers, shared memory and spill (local memory + stack, bytes per thread) from `cuobjdump "
            f"-res-usage`; occupancy is theoretical (resident warps / max warps per SM). Static facts about "
            f"the binaries a GPU would run, not timings. Command: `python bench/bench_kernel_compile.py --results`.",
            "",
            *summary,
            "",
            *lines,
        ]
        write_subsection("Kernels (issue 7)", "Compiled for sm_80 / sm_90 without a GPU", "\n".join(body))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    raise SystemExit(main())
