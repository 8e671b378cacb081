"""The fused two-sweep lightning backward (kernels/triton/lightning_fused.py) against the torch
reference and autograd of the per-step recurrence, in float64.

Shapes are small and odd: T not a multiple of the chunk (16 here) and several chunks; dk = 18,
dv = 20, so under the interpreter (16-wide blocks) the dQ sweep walks two dk blocks and the
dK/dV sweep two dv blocks (their dK and decay-gradient shares summed afterwards). With a CUDA
device the tests run there on the compiled kernels; without one, in a child pytest process under
TRITON_INTERPRET=1.
"""

import pytest
import torch

from tests.interpreted import INTERPRETED, run_under_interpreter

F64 = torch.float64
ON_CUDA = torch.cuda.is_available() and not INTERPRETED
DEV = torch.device("cuda" if ON_CUDA else "cpu")


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-300)).item()


if not INTERPRETED and not ON_CUDA:

    @pytest.mark.slow  # the default suite stays under 15 min on 2 cores; `make test-all` runs it (33 s under the interpreter)
    def test_fused_lightning_backward_under_interpreter():
        run_under_interpreter(__file__)

else:
    from gradshard.kernels.lightning_torch import lightning_bwd_torch, lightning_naive
    from gradshard.kernels.triton.lightning import lightning_bwd_triton
    from gradshard.kernels.triton.lightning_fused import _fused_backward, fused_backward_tiles

    def inputs(batch, length, decay, dk=18, dv=20, dtype=F64, seed=0):
        g = torch.Generator().manual_seed(seed)
        q, k = (torch.randn(batch, 2, length, dk, generator=g, dtype=F64) for _ in range(2))
        v, do = (torch.randn(batch, 2, length, dv, generator=g, dtype=F64) for _ in range(2))
        s0, ds = (torch.randn(batch, 2, dk, dv, generator=g, dtype=F64) for _ in range(2))
        d = {"none": None,
             "head": (0.5 + 0.5 * torch.rand(2, generator=g, dtype=F64)).view(1, 2, 1).expand(batch, 2, length),
             "steps": 0.3 + 0.7 * torch.rand(batch, 2, length, generator=g, dtype=F64)}[decay]
        cast = lambda t: None if t is None else t.to(DEV, dtype)  # noqa: E731
        return [cast(t) for t in (q, k, v, d)] + [s0.to(DEV), cast(do), ds.to(DEV)]

    @pytest.mark.parametrize(
        "length,batch,decay,with_s0,with_ds",
        [(1, 1, "steps", True, True), (19, 2, "steps", True, False), (37, 1, "steps", False, True),
         (37, 2, "head", True, True), (40, 1, "none", False, False), (33, 2, "none", True, True),
         (48, 1, "steps", False, False)],
    )
    def test_fused_backward_matches_the_torch_reference(length, batch, decay, with_s0, with_ds):
        q, k, v, d, s0, do, ds = inputs(batch, length, decay)
        s0, ds = s0 if with_s0 else None, ds if with_ds else None
        got = lightning_bwd_triton(q, k, v, d, s0, do, ds, 16, F64, fused=True)
        ref = lightning_bwd_torch(q, k, v, d, s0, do, ds, 16, F64)
        for x, y in zip(got, ref):
            assert (x is None) == (y is None)
            assert x is None or (x.shape == y.shape and rel(x, y) <= 1e-12)

    @pytest.mark.parametrize("decay", ["steps", "zeros", "head"])
    def test_fused_backward_matches_autograd_of_the_recurrence(decay):
        """Every gradient against autograd through the per-step recurrence, including exactly
        zero and tiny (1e-6) decays, where a log- or division-based decay gradient breaks."""
        q, k, v, d, s0, do, ds = inputs(2, 37, "steps" if decay != "head" else "head", dk=17, dv=21, seed=4)
        if decay == "zeros":
            d = d * 1e-6
            d[:, :, ::5] = 0.0
        leaf_d = d[0, :, 0].clone() if decay == "head" else d.clone()
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, leaf_d, s0)]
        o, s = lightning_naive(*leaves)
        ref = torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves)
        step_d = leaf_d.view(1, 2, 1).expand(2, 2, 37) if decay == "head" else leaf_d
        dq, dk, dv, dd, ds0 = lightning_bwd_triton(q, k, v, step_d, s0, do, ds, 16, F64, fused=True)
        dd = dd.sum((0, 2)) if decay == "head" else dd
        for x, y in zip((dq, dk, dv, dd, ds0), ref):
            assert x.shape == y.shape and torch.isfinite(x).all() and rel(x, y) <= 1e-10

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_fused_and_chunk_parallel_backward_agree_in_low_precision(dtype):
        q, k, v, d, s0, do, ds = inputs(1, 37, "steps", dtype=dtype, seed=2)
        fused = lightning_bwd_triton(q, k, v, d, s0, do, ds, 16, torch.float32, fused=True)
        parallel = lightning_bwd_triton(q, k, v, d, s0, do, ds, 16, torch.float32, fused=False)
        ref = lightning_bwd_torch(*(t.double() for t in (q, k, v, d, s0, do, ds)), 16, F64)
        for x, y, r in zip(fused, parallel, ref):
            # float32 accumulation; half inputs' dots run in tf32 on a GPU; bf16 outputs rounded
            tol = max(2 * torch.finfo(x.dtype).eps, 2.0**-9 if ON_CUDA and dtype != torch.float32 else 1e-5)
            assert x.dtype == y.dtype and rel(x, r) <= tol and rel(x, y) <= 2 * tol

    def test_empty_sequence_passes_the_state_gradient_through():
        q, k, v, d, s0, do, ds = inputs(1, 0, "steps")
        dq, _, _, dd, ds0 = lightning_bwd_triton(q, k, v, d, s0, do, ds, 16, F64, fused=True)
        assert dq.shape == q.shape and dd.shape == (1, 2, 0) and torch.equal(ds0, ds)

    def test_the_fused_backward_is_chosen_only_where_it_compiles_clean_and_tiles_walk_blocks():
        assert not _fused_backward(64, 64, 64, 64, torch.device("cpu"), torch.bfloat16, False)
        # spills in the ahead-of-time compile: a decay, float32, heads above 64
        gpu = torch.device("cuda")
        assert not _fused_backward(64, 64, 64, 64, gpu, torch.bfloat16, True)
        assert not _fused_backward(64, 64, 64, 64, gpu, torch.float32, False)
        assert not _fused_backward(64, 64, 128, 64, gpu, torch.bfloat16, False)
        if not ON_CUDA:
            tiles = fused_backward_tiles(64, 18, 20)
            assert (tiles.dq_block_k, tiles.dkv_block_v) == (16, 16)  # two blocks of each kind above
