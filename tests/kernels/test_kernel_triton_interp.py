"""Triton kernels vs the torch reference: compiled on CUDA, under the Triton interpreter on CPU.

With a CUDA device the tests run directly on it (the kernels compiled for the GPU). Without one,
Triton picks interpreter mode when the kernels are defined, so the tests run in a child pytest
process started with TRITON_INTERPRET=1; the parent only launches it and reports.
Tolerances: float64 1e-12 (same arithmetic, different association), float32 1e-5 relative,
float16/bfloat16 two output ulps (accumulation is float32, only the output is rounded).
"""

import pytest
import torch

from tests.interpreted import INTERPRETED, run_under_interpreter

F64 = torch.float64
ON_CUDA = torch.cuda.is_available() and not INTERPRETED
DEV = torch.device("cuda" if ON_CUDA else "cpu")


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-300)).item()


def tol(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2 * torch.finfo(dtype).eps)


if not INTERPRETED and not ON_CUDA:

    def test_triton_kernels_under_interpreter(pytestconfig):
        run_under_interpreter(__file__, markexpr=pytestconfig.getoption("markexpr"))

else:
    import gradshard.kernels as gk
    from gradshard.kernels.adjoint import adjoint_shard_torch
    from gradshard.kernels.lightning_torch import lightning_bwd_torch, lightning_fwd_torch, lightning_naive
    from gradshard.kernels.scan_torch import scan_naive
    from gradshard.kernels.triton.adjoint import adjoint_shard_triton
    from gradshard.kernels.triton.lightning import lightning_bwd_triton, lightning_fwd_triton
    from gradshard.kernels.triton.scan import Tiles, scan_triton

    def scan_inputs(batch, length, a_shape=None, dtype=F64, seed=0):
        g = torch.Generator().manual_seed(seed)
        a = torch.rand(a_shape or (batch, length, 2, 3), generator=g, dtype=F64) * 2 - 1
        a[a.abs() < 0.1] = 0.0
        u = torch.randn(batch, length, 2, 3, generator=g, dtype=F64)
        h0 = torch.randn(batch, 2, 3, generator=g, dtype=F64)
        return a.to(DEV, dtype), u.to(DEV, dtype), h0.to(DEV, dtype)

    @pytest.mark.parametrize(
        "length,batch,reverse,with_h0,chunk",
        [(1, 1, False, True, None), (7, 3, True, False, None), (37, 1, False, True, None),
         (37, 3, True, True, None), (37, 3, False, True, 10), (37, 1, True, False, 8)],
    )
    def test_scan_matches_loop(length, batch, reverse, with_h0, chunk):
        a, u, h0 = scan_inputs(batch, length)
        h0 = h0 if with_h0 else None
        out = scan_triton(a, u, h0, reverse=reverse, chunk=chunk)
        assert rel(out, scan_naive(a, u, h0, reverse)) <= tol(F64)

    _TILES = {"prefetch": Tiles(8, 16, 4, prefetch=True), "lookback": Tiles(8, 16, 4, lookback=True),
              "lookback16": Tiles(16, 16, 2, lookback=True)}
    _SHAPES = [(1, 1, False, True, None), (37, 3, True, True, None), (37, 3, False, False, 10),
               (64, 2, False, True, None), (41, 1, True, False, 8)]
    # default suite: per variant the one-step and the ragged reversed chunked shapes, and the exact
    # tile count once; `make test-all` runs every pair
    _DEFAULT = {(1, 1, False, True, None), (41, 1, True, False, 8), ("lookback", (64, 2, False, True, None))}

    @pytest.mark.parametrize("tiles,length,batch,reverse,with_h0,chunk", [
        pytest.param(tile, *shape, id=f"{'-'.join(map(str, shape))}-{name}",
                     marks=() if shape in _DEFAULT or (name, shape) in _DEFAULT else pytest.mark.slow)
        for shape in _SHAPES for name, tile in _TILES.items()])
    def test_scan_launch_variants_match_loop(tiles, length, batch, reverse, with_h0, chunk):
        """Register prefetch (one pass and chunked) and the one-pass look-back kernel, on ragged
        and exact tile counts, with broadcast coefficients and in place over ``u``."""
        a, u, h0 = scan_inputs(batch, length)
        h0 = h0 if with_h0 else None
        ref = scan_naive(a, u, h0, reverse)
        assert rel(scan_triton(a, u, h0, reverse=reverse, chunk=chunk, tiles=tiles), ref) <= tol(F64)
        a_b = a[..., :1].contiguous()
        assert rel(scan_triton(a_b, u, h0, reverse=reverse, tiles=tiles), scan_naive(a_b, u, h0, reverse)) <= tol(F64)
        u2 = u.clone()
        scan_triton(a, u2, h0, reverse=reverse, tiles=tiles, out=u2)
        assert rel(u2, ref) <= tol(F64)

    @pytest.mark.parametrize("reverse,chunk", [(False, None), (True, None), (False, 8), (True, 10)])
    def test_scan_in_place_over_its_input(reverse, chunk):
        """``out=u``: each program reads a tile of u before writing it (the lightning chunk scan)."""
        a, u, h0 = scan_inputs(3, 37)
        want = scan_naive(a, u, h0, reverse)
        buf = u.clone()
        got = scan_triton(a, buf, h0, reverse=reverse, chunk=chunk, out=buf)
        assert got.data_ptr() == buf.data_ptr() and rel(got, want) <= tol(F64)
        with pytest.raises(ValueError, match="contiguous"):
            scan_triton(a, u, h0, out=torch.empty(3, 2, 37, 3, dtype=F64, device=DEV).transpose(1, 2))

    @pytest.mark.parametrize("a_shape", [(3, 19, 2, 1), (1, 19, 2, 3), (3, 1, 2, 3)])
    def test_scan_broadcast_coefficients(a_shape):
        a, u, h0 = scan_inputs(3, 19, a_shape=a_shape)
        for reverse in (False, True):
            assert rel(scan_triton(a, u, h0, reverse=reverse, chunk=8), scan_naive(a, u, h0, reverse)) <= tol(F64)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_scan_low_precision(dtype):
        a, u, h0 = scan_inputs(2, 19, dtype=dtype)
        out = gk.linear_scan(a, u, h0, backend="triton")
        assert out.dtype == dtype
        assert rel(out, scan_naive(a.double(), u.double(), h0.double())) <= tol(dtype)

    def test_scan_autograd_on_triton_backend():
        a, u, h0 = scan_inputs(2, 13)
        for t in (a, u, h0):
            t.requires_grad_(True)
        g = torch.randn(u.shape, dtype=F64, generator=torch.Generator().manual_seed(3)).to(DEV)
        got = torch.autograd.grad((gk.linear_scan(a, u, h0, backend="triton") * g).sum(), (a, u, h0))
        ref = torch.autograd.grad((scan_naive(a, u, h0) * g).sum(), (a, u, h0))
        for x, y in zip(got, ref):
            assert rel(x, y) <= 1e-10

    @pytest.mark.parametrize(
        "length,with_state,per_head", [(1, True, False), (7, False, True), (37, True, True), (37, True, False)]
    )
    def test_adjoint_shard_matches_torch(length, with_state, per_head):
        a, u, h0 = scan_inputs(3, length, a_shape=(3, length, 2, 1) if per_head else None)
        g = torch.randn(u.shape, dtype=F64, generator=torch.Generator().manual_seed(5)).to(DEV)
        carry = torch.randn(h0.shape, dtype=F64, generator=torch.Generator().manual_seed(6)).to(DEV)
        h0, carry = (h0, carry) if with_state else (None, None)
        got = adjoint_shard_triton(a, u, g, h0, carry, (F64, F64, F64))
        ref = adjoint_shard_torch(a, u, g, h0, carry)
        for x, y in zip(got, ref):
            assert x.shape == y.shape and rel(x, y) <= tol(F64)
        via_op = gk.adjoint_shard(a, u, g, h0, carry, backend="triton")
        assert all(torch.equal(x, y) for x, y in zip(via_op, got))

    def lightning_inputs(batch, length, decay, dtype=F64, seed=0):
        g = torch.Generator().manual_seed(seed)
        q, k = (torch.randn(batch, 2, length, 5, generator=g, dtype=F64) for _ in range(2))
        v, do = (torch.randn(batch, 2, length, 6, generator=g, dtype=F64) for _ in range(2))
        s0, ds = (torch.randn(batch, 2, 5, 6, generator=g, dtype=F64) for _ in range(2))
        d = {"none": None, "head": (0.5 + 0.5 * torch.rand(2, generator=g, dtype=F64)).view(1, 2, 1).expand(batch, 2, length),
             "steps": 0.3 + 0.7 * torch.rand(batch, 2, length, generator=g, dtype=F64)}[decay]
        cast = lambda t: None if t is None else t.to(DEV, dtype)  # noqa: E731
        return [cast(t) for t in (q, k, v, d)] + [s0.to(DEV), do.to(DEV, dtype), ds.to(DEV)]

    @pytest.mark.parametrize(
        "length,batch,decay,with_state",
        [(1, 1, "steps", True), (7, 3, "none", False), (37, 1, "head", True), (37, 3, "steps", True),
         (37, 1, "steps", False)],
    )
    def test_lightning_fwd_bwd_match_torch(length, batch, decay, with_state):
        q, k, v, d, s0, do, ds = lightning_inputs(batch, length, decay)
        s0, ds = (s0, ds) if with_state else (None, None)
        got = lightning_fwd_triton(q, k, v, d, s0, 16, F64, F64)
        ref = lightning_fwd_torch(q, k, v, d, s0, 16, F64)
        assert all(rel(x, y) <= tol(F64) for x, y in zip(got, ref))
        got = lightning_bwd_triton(q, k, v, d, s0, do, ds, 16, F64)
        ref = lightning_bwd_torch(q, k, v, d, s0, do, ds, 16, F64)
        for x, y in zip(got, ref):
            assert (x is None) == (y is None)
            assert x is None or rel(x, y) <= tol(F64)

    @pytest.mark.parametrize("length", [0, 19])
    def test_lightning_wide_heads_span_several_dv_blocks(length):
        """dk=18, dv=20: the forward grid splits dv into 16-wide blocks under the interpreter
        (and T=19 into a full and a ragged 16-step chunk)."""
        g = torch.Generator().manual_seed(3)
        q, k = (torch.randn(1, 2, length, 18, generator=g, dtype=F64) for _ in range(2))
        v, do = (torch.randn(1, 2, length, 20, generator=g, dtype=F64) for _ in range(2))
        s0, ds = (torch.randn(1, 2, 18, 20, generator=g, dtype=F64) for _ in range(2))
        d = 0.3 + 0.7 * torch.rand(1, 2, length, generator=g, dtype=F64)
        q, k, v, do, s0, ds, d = (t.to(DEV) for t in (q, k, v, do, s0, ds, d))
        got = lightning_fwd_triton(q, k, v, d, s0, 16, F64, F64)
        ref = lightning_fwd_torch(q, k, v, d, s0, 16, F64) if length else (v.clone(), s0.clone())
        assert all(x.shape == y.shape and rel(x, y) <= tol(F64) for x, y in zip(got, ref))
        if length:
            got = lightning_bwd_triton(q, k, v, d, s0, do, ds, 16, F64)
            ref = lightning_bwd_torch(q, k, v, d, s0, do, ds, 16, F64)
            assert all(rel(x, y) <= tol(F64) for x, y in zip(got, ref))
        else:
            *_, ds0 = lightning_bwd_triton(q, k, v, d, s0, do, ds, 16, F64)
            assert torch.equal(ds0, ds)

    @pytest.mark.parametrize("length, decay, with_state", [(19, "steps", True), (40, None, False), (33, "heads", True)])
    def test_the_fused_forward_matches_the_chunk_parallel_one(length, decay, with_state):
        """The sequential fused forward (state in registers) against the torch reference, with
        dk=18 / dv=20 so its grid spans several dv blocks, and ragged last chunks."""
        g = torch.Generator().manual_seed(5)
        q, k = (torch.randn(2, 2, length, 18, generator=g, dtype=F64).to(DEV) for _ in range(2))
        v = torch.randn(2, 2, length, 20, generator=g, dtype=F64).to(DEV)
        s0 = torch.randn(2, 2, 18, 20, generator=g, dtype=F64).to(DEV) if with_state else None
        d = {"steps": 0.3 + 0.7 * torch.rand(2, 2, length, generator=g, dtype=F64),
             "heads": (0.5 + 0.4 * torch.rand(2, generator=g, dtype=F64))[None, :, None].expand(2, 2, length),
             None: None}[decay]
        d = None if d is None else d.to(DEV)
        got = lightning_fwd_triton(q, k, v, d, s0, 16, F64, F64, fused=True)
        ref = lightning_fwd_torch(q, k, v, d, s0, 16, F64)
        assert all(x.shape == y.shape and rel(x, y) <= tol(F64) for x, y in zip(got, ref))

    def test_lightning_op_autograd_on_triton_backend():
        q, k, v, d, s0, do, ds = lightning_inputs(2, 21, "steps")
        d = d.clone()
        leaves = [q, k, v, d, s0]
        for t in leaves:
            t.requires_grad_(True)
        o, s = gk.lightning_attention(q, k, v, d, initial_state=s0, chunk_size=16, backend="triton")
        o_ref, s_ref = lightning_naive(q, k, v, d, s0)
        assert rel(o, o_ref) <= tol(F64) and rel(s, s_ref) <= tol(F64)
        got = torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves)
        ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), leaves)
        for x, y in zip(got, ref):
            assert rel(x, y) <= 1e-10

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_lightning_low_precision(dtype):
        """Half inputs: the kernels' dots run in tf32 on the GPU (10-bit mantissa), so the float32
        state is good to tf32's rounding there; the interpreter computes those dots in full fp32."""
        q, k, v, d, s0, do, ds = lightning_inputs(1, 21, "steps", dtype=dtype)
        o, s = lightning_fwd_triton(q, k, v, d, s0, 16, dtype, torch.float32)
        o_ref, s_ref = lightning_naive(*(t.double() for t in (q, k, v, d, s0)))
        state_tol = 2 * 2.0**-10 if ON_CUDA and dtype != torch.float32 else 1e-5
        assert o.dtype == dtype and rel(o, o_ref) <= tol(dtype) and rel(s, s_ref) <= state_tol
        got = lightning_bwd_triton(q, k, v, d, s0, do, ds, 16, torch.float32)
        ref = lightning_bwd_torch(*(t.double() for t in (q, k, v, d, s0, do, ds)), 16, F64)
        for x, y in zip(got, ref):
            assert rel(x, y) <= max(tol(dtype), 1e-5)
