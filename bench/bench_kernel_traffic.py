"""Bytes each Triton kernel moves, counted in Triton's interpreter, against the op's minimum (issue 19).

Without a GPU the HBM traffic of a kernel can still be counted exactly as the kernel asks for
it: every ``tl.load``/``tl.store`` element its masks let through, times its size, per kernel
(``TRITON_INTERPRET=1``; caches ignored, so it is what DRAM would move with no reuse between
programs; the look-back scan's flag atomics are not counted). The minimum is what the op must
move: each input read once, each output written once (for the scans: a, u, h0 in; h out; for
the adjoint shard: a, u, g, h0 in; grad_a, grad_u, grad_h0 out; for lightning attention: q, k,
v, decay, S0 in; o, S_T out, and backward dO, dS_T in; dq, dk, dv, d(decay), dS0 out).

Tiles: the ones a launch on an H100/H200 with ample programs picks (the interpreter's own tiny
tiles would count different traffic): given to the scans, and the lightning launchers run with
their GPU tile rules (:func:`gpu_tiles`; the chunk-state scan inside keeps the interpreter's).

    python bench/bench_kernel_traffic.py
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

MiB = 2**20


@contextmanager
def counting() -> Iterator[dict[str, list[int]]]:
    """Count the bytes every kernel launched inside the block loads and stores:
    ``{kernel name: [bytes read, bytes written]}``."""
    import numpy as np
    from triton.runtime import interpreter as interp

    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    current = ["?"]
    builder = interp.interpreter_builder
    load, store, call = builder.create_masked_load, builder.create_masked_store, interp.GridExecutor.__call__

    def counted_load(ptrs, mask, other, cache_policy, is_volatile):
        ret = load(ptrs, mask, other, cache_policy, is_volatile)
        counts[current[0]][0] += int(np.count_nonzero(mask.data)) * ret.data.dtype.itemsize
        return ret

    def counted_store(ptrs, value, mask, cache_policy):
        counts[current[0]][1] += int(np.count_nonzero(mask.data)) * value.data.dtype.itemsize
        return store(ptrs, value, mask, cache_policy)

    def named_call(self, *args, **kwargs):
        current[0] = self.fn.__name__
        return call(self, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
    interp.GridExecutor.__call__ = named_call
    try:
        yield counts
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
        interp.GridExecutor.__call__ = call


def nbytes(*ts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def gpu_tiles(launcher: Callable[..., Any]) -> Callable[..., Any]:
    """``launcher`` choosing the lightning kernels' tiles as on a GPU (under the interpreter they
    pick the smallest blocks, which would count a different traffic)."""
    import gradshard.kernels.triton.lightning as lightning
    import gradshard.kernels.triton.lightning_fused as lightning_fused

    def call(*args: Any, **kwargs: Any) -> Any:
        lightning.INTERPRETED = lightning_fused.INTERPRETED = False
        try:
            return launcher(*args, **kwargs)
        finally:
            lightning.INTERPRETED = lightning_fused.INTERPRETED = True

    return call


def cases() -> list[tuple[str, Callable[[], Any], int]]:
    """(name, a call that launches the op's kernels, the op's minimum bytes)."""
    from gradshard.kernels.triton.adjoint import adjoint_shard_triton
    from gradshard.kernels.triton.lightning import lightning_bwd_triton, lightning_fwd_triton
    from gradshard.kernels.triton.scan import Tiles, scan_triton

    g = torch.Generator().manual_seed(0)
    out = []
    B, T, N = 1, 512, 64
    for dt in (torch.float32, torch.bfloat16):
        a = (torch.rand(B, T, N, generator=g) * 0.5 + 0.5).to(dt)
        u = torch.randn(B, T, N, generator=g).to(dt)
        gr = torch.randn(B, T, N, generator=g).to(dt)
        h0 = torch.randn(B, N, generator=g)
        name = str(dt).replace("torch.", "")
        h_bytes = B * T * N * 4  # scans write the float32 accumulation
        out.append((f"scan, one pass (128x32 tiles, prefetch), {name}",
                    lambda a=a, u=u, h0=h0: scan_triton(a, u, h0, tiles=Tiles(128, 32, 4, prefetch=True)),
                    nbytes(a, u, h0) + h_bytes))
        out.append((f"scan, look-back (64x32 tiles), {name}",
                    lambda a=a, u=u, h0=h0: scan_triton(a, u, h0, tiles=Tiles(64, 32, 2, lookback=True)),
                    nbytes(a, u, h0) + h_bytes))
        out.append((f"scan, two-pass chunked (8 chunks), {name}",
                    lambda a=a, u=u, h0=h0: scan_triton(a, u, h0, chunk=T // 8, tiles=Tiles(128, 32, 4)),
                    nbytes(a, u, h0) + h_bytes))
        outs = (torch.float32, dt, torch.float32)
        out.append((f"adjoint shard (64x16 tiles), {name}",
                    lambda a=a, u=u, gr=gr, h0=h0: adjoint_shard_triton(a, u, gr, h0, None, outs, tiles=(64, 16, 2, 3)),
                    nbytes(a, u, gr, h0) + B * T * N * (4 + u.element_size()) + B * N * 4))
    Bh, H, Tl, d = 1, 1, 256, 64
    for dt in (torch.float32, torch.bfloat16):
        q, k, v, do = (torch.randn(Bh, H, Tl, d, generator=g).to(dt) for _ in range(4))
        decay = torch.rand(Bh, H, Tl, generator=g) * 0.1 + 0.9
        s0 = torch.randn(Bh, H, d, d, generator=g)
        ds = torch.randn(Bh, H, d, d, generator=g)
        name = str(dt).replace("torch.", "")
        fwd_min = nbytes(q, k, v, decay, s0) + nbytes(v) + nbytes(s0)  # o in the inputs' dtype, S_T in float32
        for fused in (False, True):
            out.append((f"lightning forward{', fused' if fused else ''} (d=64, chunk 64), {name}",
                        lambda q=q, k=k, v=v, decay=decay, s0=s0, dt=dt, fused=fused: gpu_tiles(lightning_fwd_triton)(
                            q, k, v, decay, s0, 64, dt, torch.float32, fused=fused),
                        fwd_min))
        bwd_min = nbytes(q, k, v, decay, s0, do, ds) + nbytes(q, k, v) + nbytes(decay) + nbytes(s0)
        for fused in (False, True):
            out.append((f"lightning backward{', fused' if fused else ''} (d=64, chunk 64), {name}",
                        lambda q=q, k=k, v=v, decay=decay, s0=s0, do=do, ds=ds, fused=fused: gpu_tiles(
                            lightning_bwd_triton)(q, k, v, decay, s0, do, ds, 64, torch.float32, fused=fused),
                        bwd_min))
        out.append((f"lightning backward, fused, no decay (d=64, chunk 64), {name}",
                    lambda q=q, k=k, v=v, s0=s0, do=do, ds=ds: gpu_tiles(lightning_bwd_triton)(
                        q, k, v, None, s0, do, ds, 64, torch.float32, fused=True),
                    bwd_min - 2 * nbytes(decay)))
    return out


def table() -> str:
    rows = ["| op | kernel | read | written | total / op minimum |", "|---|---|---|---|---|"]
    for name, fn, minimum in cases():
        with counting() as counts:
            fn()
        total = sum(r + w for r, w in counts.values())
        for kernel, (r, w) in counts.items():
            rows.append(f"| {name} | `{kernel}` | {r / MiB:.2f} MiB | {w / MiB:.2f} MiB | |")
        rows.append(f"| **{name}** | all | | | **{total / minimum:.2f}x** ({total / MiB:.2f} of {minimum / MiB:.2f} MiB) |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
