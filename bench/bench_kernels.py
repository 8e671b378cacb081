"""Time gradshard.kernels and report achieved bandwidth and FLOP rate as a markdown table.

Usage::

    python bench/bench_kernels.py            # torch backend on CPU; + triton when CUDA is present
    python bench/bench_kernels.py --quick    # small shapes (seconds)

Rates use the *minimum* traffic and the FLOPs of the algorithm, so they are lower bounds of what
the hardware did:

* scan fwd: read a, u, write h (3 tensors); 2 FLOPs per element.
* scan fwd+bwd: fwd, then read a, g, h, write da, du (8 tensors); 2 + 4 FLOPs per element.
* adjoint_shard: read a, u, g, write grad_a, grad_u (5 tensors); 6 FLOPs per element.
* lightning fwd (chunk C): read q, k, v, write o; FLOPs per (b, h) =
  2 T C (dk + dv) + 4 T dk dv  (intra-chunk QK^T and (.)V, inter-chunk Q S and K^T V).
* lightning fwd+bwd: forward, then read q, k, v, do, write dq, dk, dv; backward FLOPs =
  2 T C (3 dk + 3 dv) + 10 T dk dv  (+ 2 T C^2 for the exact decay gradient).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Callable

import torch

import gradshard.kernels as gk


def describe_device(device: torch.device) -> str:
    """One line naming the machine the numbers come from."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"CPU {cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def timeit(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` runs after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def scan_cases(device, dtype, batch, length, state, backend):
    g = torch.Generator(device="cpu").manual_seed(0)
    a = (0.9 + 0.1 * torch.rand(batch, length, state, generator=g)).to(device, dtype)
    u = torch.randn(batch, length, state, generator=g).to(device, dtype)
    numel, size = a.numel(), a.element_size()

    def fwd():
        return gk.linear_scan(a, u, backend=backend)

    a_g, u_g = a.clone().requires_grad_(True), u.clone().requires_grad_(True)
    grad = torch.randn_like(u)

    def fwd_bwd():
        return torch.autograd.grad(gk.linear_scan(a_g, u_g, backend=backend), (a_g, u_g), grad)

    def adjoint():
        return gk.adjoint_shard(a, u, grad, backend=backend)

    shape = f"B={batch} T={length} N={state}"
    return [
        ("linear_scan fwd", shape, fwd, 3 * numel * size, 2 * numel),
        ("linear_scan fwd+bwd", shape, fwd_bwd, 8 * numel * size, 6 * numel),
        ("adjoint_shard", shape, adjoint, 5 * numel * size, 6 * numel),
    ]


def lightning_cases(device, dtype, batch, heads, length, dk, dv, chunk, backend):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k = (torch.randn(batch, heads, length, dk, generator=g).div(dk**0.5).to(device, dtype) for _ in range(2))
    v = torch.randn(batch, heads, length, dv, generator=g).to(device, dtype)
    d = (0.95 + 0.05 * torch.rand(batch, heads, length, generator=g)).to(device, dtype)
    bh, size = batch * heads, q.element_size()
    io = bh * length * (2 * dk + 2 * dv) * size
    f_fwd = bh * (2 * length * chunk * (dk + dv) + 4 * length * dk * dv)
    f_bwd = bh * (2 * length * chunk * (3 * dk + 3 * dv) + 10 * length * dk * dv + 2 * length * chunk * chunk)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, d)]

    def fwd():
        return gk.lightning_attention(q, k, v, d, chunk_size=chunk, backend=backend)

    def fwd_bwd():
        o, s = gk.lightning_attention(*leaves, chunk_size=chunk, backend=backend)
        return torch.autograd.grad(o.sum() + s.sum(), leaves)

    shape = f"B={batch} H={heads} T={length} dk={dk} dv={dv} C={chunk}"
    return [
        ("lightning fwd", shape, fwd, io, f_fwd),
        ("lightning fwd+bwd", shape, fwd_bwd, io + bh * length * (3 * dk + 3 * dv) * size, f_fwd + f_bwd),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    if args.quick:
        scan_shape, light_shape = (2, 4096, 64), (1, 2, 2048, 64, 64, 64)
    else:
        scan_shape, light_shape = (2, 65536, 256), (1, 4, 16384, 64, 64, 64)
    rows = []
    for device in devices:
        backends = ["torch"] + (["triton"] if device.type == "cuda" and "triton" in gk.available_backends() else [])
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            print("note: TRITON_INTERPRET=1 is set; the interpreter is far too slow to benchmark, timing torch only")
        for backend in backends:
            cases = scan_cases(device, dtype, *scan_shape, backend) + lightning_cases(device, dtype, *light_shape, backend)
            for name, shape, fn, nbytes, flops in cases:
                sec = timeit(fn, device, args.reps)
                rows.append((describe_device(device), backend, name, shape, sec, nbytes / sec / 1e9, flops / sec / 1e9))
    print(f"## gradshard.kernels ({args.dtype})\n")
    for dev in dict.fromkeys(r[0] for r in rows):
        print(f"Device: {dev}\n")
        print("| kernel | backend | shape | time (ms) | GB/s (min traffic) | GFLOP/s |")
        print("|---|---|---|---:|---:|---:|")
        for r in rows:
            if r[0] == dev:
                print(f"| {r[2]} | {r[1]} | {r[3]} | {1e3 * r[4]:.1f} | {r[5]:.2f} | {r[6]:.2f} |")
        print()


if __name__ == "__main__":
    main()
