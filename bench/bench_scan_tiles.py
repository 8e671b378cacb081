"""Time the Triton linear scan and adjoint-shard kernels over launch configurations, on a CUDA device.

    python bench/bench_scan_tiles.py                          # scan, float32 and bfloat16, bench_kernels shapes
    python bench/bench_scan_tiles.py --kernel adjoint --dtypes float32
    python bench/bench_scan_tiles.py --kernel lookback
    python bench/bench_scan_tiles.py --shapes 4x16384x2048 --budget-s 60 --json out.json

For each shape ``B x T x N`` and dtype, every configuration of the grid below: for ``scan``
(forward ``linear_scan``) the tile ``(BLOCK_T, BLOCK_N)``, warps, Triton's ``num_stages`` and
the kernel's register prefetch of the next tile, in one pass (``chunk=T``: each program walks
the whole sequence for its channels) when the kernel's own policy runs one pass at that shape,
else with the kernel's time chunking; for ``lookback`` the one-pass decoupled look-back scan's tiles and
warps; for ``adjoint`` (``adjoint_shard``) tile, warps and stages. Prints
GB/s at the minimum traffic (scan: read a, u, write h; adjoint: read a, u, g, write grad_a,
grad_u) and the fraction of the device's HBM bandwidth from ``gradshard.cost.devices``. The
kernels' launch policies (``_tiles`` in :mod:`gradshard.kernels.triton.scan`, ``_adjoint_tiles``
in :mod:`gradshard.kernels.triton.adjoint`) are tuned from this. ``--budget-s`` stops the sweep
of a shape early (the best so far is still printed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Callable

import torch
import triton.testing

from gradshard.cost.devices import get_device
from gradshard.kernels.adjoint import adjoint_shard_torch
from gradshard.kernels.scan_torch import scan_torch
from gradshard.kernels.triton.adjoint import adjoint_shard_triton
from gradshard.kernels.triton.scan import Tiles, _tiles, scan_triton

SCAN_GRID = dict(block_t=(128, 256, 64), block_n=(32, 64), warps=(4, 8), stages=(3,), prefetch=(False, True))
SCAN_GRID_CHUNKED = dict(block_t=(64, 32, 128), block_n=(64, 32), warps=(2, 4), stages=(3,), prefetch=(True, False))
LOOKBACK_GRID = dict(block_t=(64, 128, 32), block_n=(32, 64), warps=(2, 4), stages=(3,), prefetch=(False,),
                     lookback=(True,))
ADJOINT_GRID = dict(block_t=(64, 128, 32), block_n=(16, 32), warps=(2, 4), stages=(3,))
CHECK_STEPS = 4096


def _configs(grid: dict[str, tuple]) -> list[dict]:
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def _scan_cases(a: torch.Tensor, u: torch.Tensor, dtype: torch.dtype, lookback: bool = False
                ) -> tuple[list, Callable, float]:
    b, t, n = u.shape
    _, default_chunk = _tiles(b, n, t, u.device)
    one_pass = default_chunk == t  # the policy's form for this shape; explicit tiles would chunk otherwise
    grid = LOOKBACK_GRID if lookback else SCAN_GRID if one_pass else SCAN_GRID_CHUNKED
    ref = scan_torch(a[:, :CHECK_STEPS].float(), u[:, :CHECK_STEPS].float(), None)
    cases = []
    for cfg in _configs(grid):
        if cfg["block_t"] * cfg["block_n"] > 16384:
            continue
        tiles = Tiles(**cfg)
        chunk = t if one_pass else None
        cases.append((cfg, lambda tiles=tiles, chunk=chunk: scan_triton(a, u, None, out_dtype=dtype, tiles=tiles,
                                                                       chunk=chunk)))

    def check(out: torch.Tensor) -> float:
        got = out[:, :CHECK_STEPS].float()
        return float((got - ref).abs().max() / ref.abs().max())

    return cases, check, 3 * a.numel() * a.element_size()


def _adjoint_cases(a: torch.Tensor, u: torch.Tensor, dtype: torch.dtype) -> tuple[list, Callable, float]:
    g = torch.randn_like(u)
    dts = (dtype, dtype, dtype)
    s = CHECK_STEPS
    ref = adjoint_shard_torch(a[:, -s:].float(), u[:, -s:].float(), g[:, -s:].float(), None, None)[1]
    cases = [(cfg, lambda cfg=cfg: adjoint_shard_triton(a, u, g, None, None, dts, tiles=tuple(cfg.values())))
             for cfg in _configs(ADJOINT_GRID) if cfg["block_t"] * cfg["block_n"] <= 8192]

    def check(out: tuple) -> float:  # grad_u = lam: the last CHECK_STEPS steps do not depend on h
        got = out[1][:, -s:].float()
        return float((got - ref).abs().max() / ref.abs().max())

    return cases, check, 5 * a.numel() * a.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("scan", "lookback", "adjoint"), default="scan",
                    help="scan: the policy's form (one pass or chunked); lookback: the one-pass look-back scan")
    ap.add_argument("--shapes", default="4x16384x2048,1x65536x2048")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--profile", default=None, help="gradshard.cost device profile (default: by device name)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="wall-clock limit per shape and dtype")
    ap.add_argument("--json", default=None, help="append every measured row to this JSON file")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    profile = get_device(args.profile or ("h200" if "H200" in name else "h100"))
    hbm = profile.hbm_bandwidth
    print(f"{name}: HBM {hbm / 1e12:.2f} TB/s ({profile.name})")
    log: list[dict] = []
    for shape, dt in itertools.product(args.shapes.split(","), args.dtypes.split(",")):
        b, t, n = (int(x) for x in shape.split("x"))
        dtype = getattr(torch, dt)
        a = torch.rand(b, t, n, device="cuda").mul_(0.5).add_(0.5).to(dtype)
        u = torch.randn(b, t, n, device="cuda", dtype=dtype)
        if args.kernel == "adjoint":
            cases, check, nbytes = _adjoint_cases(a, u, dtype)
        else:
            cases, check, nbytes = _scan_cases(a, u, dtype, lookback=args.kernel == "lookback")
        own = (lambda: scan_triton(a, u, None, out_dtype=dtype)) if args.kernel != "adjoint" else (
            lambda: adjoint_shard_triton(a, u, torch.randn_like(u), None, None, (dtype,) * 3))
        base = triton.testing.do_bench(own, warmup=5, rep=40)
        print(f"== {args.kernel} {shape} {dt}: the kernel's own choice {base:.3f} ms, "
              f"{nbytes / base / 1e6:.1f} GB/s {100 * nbytes / base * 1e3 / hbm:.1f}%", flush=True)
        rows, start = [], time.monotonic()
        for cfg, run in cases:
            if time.monotonic() - start > args.budget_s:
                print(f"  budget reached after {len(rows)} of {len(cases)} configurations", flush=True)
                break
            try:
                err = check(run())
                ms = triton.testing.do_bench(run, warmup=5, rep=40)
            except Exception as exc:  # a configuration the compiler rejects (e.g. out of shared memory)
                print(f"  {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            rows.append((nbytes / ms / 1e6, cfg, ms, err))
            log.append(dict(kernel=args.kernel, shape=shape, dtype=dt, **cfg, ms=ms, pct=100 * nbytes / ms * 1e3 / hbm,
                            err=err, own_ms=base))
        rows.sort(key=lambda r: -r[0])
        print(f"== {args.kernel} {shape} {dt}: best 8 of {len(rows)}")
        for gbps, cfg, ms, err in rows[:8]:
            print(f"  {cfg} {ms:8.3f} ms {gbps:8.1f} GB/s {100 * gbps * 1e9 / hbm:5.1f}%  err {err:.1e}")
        if rows:
            print(f"  worst error of any config vs torch (checked steps): {max(r[-1] for r in rows):.1e}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(log, f, indent=1)


if __name__ == "__main__":
    main()
