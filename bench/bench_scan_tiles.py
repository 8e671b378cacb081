"""Time the Triton linear scan over tile shapes and time chunking, on a CUDA device.

    python bench/bench_scan_tiles.py                 # float32 and bfloat16, the bench_kernels shapes
    python bench/bench_scan_tiles.py --dtypes float32 --shapes 4x16384x2048

For each shape ``B x T x N`` and dtype: the forward scan with every ``(BLOCK_T, BLOCK_N,
num_warps)`` of the grid below, once in one pass (``chunk=T``: each program walks the whole
sequence for its channels) and once with the kernel's default time chunking (two passes when
``batch x channel blocks`` leaves the GPU underused). Prints GB/s at the minimum traffic (read
a, u, write h) and the fraction of the device's HBM bandwidth from ``gradshard.cost.devices``;
the kernel's tile policy (:func:`gradshard.kernels.triton.scan._tiles`) is tuned from this.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

from gradshard.cost.devices import get_device
from gradshard.kernels.scan_torch import scan_torch
from gradshard.kernels.triton.scan import scan_triton

BLOCK_T = (32, 64, 128)
BLOCK_N = (16, 32, 64)
WARPS = (2, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4x16384x2048,1x65536x2048")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--profile", default=None, help="gradshard.cost device profile (default: by device name)")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    profile = get_device(args.profile or ("h200" if "H200" in name else "h100"))
    print(f"{name}: HBM {profile.hbm_bandwidth / 1e12:.2f} TB/s ({profile.name})")
    for shape, dt in itertools.product(args.shapes.split(","), args.dtypes.split(",")):
        b, t, n = (int(x) for x in shape.split("x"))
        dtype = getattr(torch, dt)
        a = torch.rand(b, t, n, device="cuda").mul_(0.5).add_(0.5).to(dtype)
        u = torch.randn(b, t, n, device="cuda", dtype=dtype)
        ref = scan_torch(a[:, :4096].float(), u[:, :4096].float(), None)
        nbytes = 3 * a.numel() * a.element_size()
        rows = []
        for bt, bn, w in itertools.product(BLOCK_T, BLOCK_N, WARPS):
            if bt * bn // (32 * w) < 1 or bt * bn > 8192:
                continue
            for one_pass in (True, False):
                tiles = (bt, bn, w)
                run = lambda: scan_triton(a, u, None, out_dtype=dtype, chunk=t if one_pass else None, tiles=tiles)  # noqa: E731
                got = run()[:, :4096].float()
                err = float((got - ref).abs().max() / ref.abs().max())
                ms = triton.testing.do_bench(run, warmup=5, rep=40)
                rows.append((nbytes / ms / 1e6, bt, bn, w, one_pass, ms, err))
        base = triton.testing.do_bench(lambda: scan_triton(a, u, None, out_dtype=dtype), warmup=5, rep=40)
        print(f"== {shape} {dt}: the kernel's own choice {base:.3f} ms, {nbytes / base / 1e6:.1f} GB/s "
              f"{100 * nbytes / base * 1e3 / profile.hbm_bandwidth:.1f}%")
        rows.sort(reverse=True)
        print(f"== {shape} {dt}: best 8 of {len(rows)}")
        for gbps, bt, bn, w, one_pass, ms, err in rows[:8]:
            print(f"  BLOCK_T={bt:4d} BLOCK_N={bn:4d} warps={w} {'one pass ' if one_pass else 'chunked  '} "
                  f"{ms:8.3f} ms {gbps:8.1f} GB/s {100 * gbps * 1e9 / profile.hbm_bandwidth:5.1f}%  err {err:.1e}")
        worst = max(r[-1] for r in rows)
        print(f"  worst error of any config vs torch (first 4096 steps): {worst:.1e}")


if __name__ == "__main__":
    main()
