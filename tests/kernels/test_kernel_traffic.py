"""The bytes the Triton kernels move, counted in the interpreter (bench/bench_kernel_traffic.py):
the scans a launch picks move their op's minimum; the counter names each kernel it counts.

The counting needs the interpreter, so without TRITON_INTERPRET=1 the tests run in a child
pytest process started with it (on a CUDA machine too)."""

import pytest
import torch

from tests.interpreted import INTERPRETED, run_under_interpreter

if not INTERPRETED:

    def test_kernel_traffic_under_interpreter():
        run_under_interpreter(__file__)

else:
    from gradshard.bench.bench_kernel_traffic import counting, gpu_tiles, nbytes
    from gradshard.kernels.triton.lightning import lightning_bwd_triton, lightning_fwd_triton
    from gradshard.kernels.triton.scan import Tiles, scan_triton

    def _scan_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        a = (torch.rand(2, 100, 48, generator=g) * 0.5 + 0.5).to(dtype)
        return a, torch.randn(2, 100, 48, generator=g).to(dtype), torch.randn(2, 48, generator=g)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_the_one_pass_scan_moves_its_minimum(dtype: torch.dtype) -> None:
        a, u, h0 = _scan_inputs(dtype)
        with counting() as counts:
            h = scan_triton(a, u, h0, tiles=Tiles(128, 32, 4, prefetch=True))
        assert list(counts) == ["_scan_chunk_kernel"]
        read, written = counts["_scan_chunk_kernel"]
        assert (read, written) == (nbytes(a, u, h0), nbytes(h))  # masked tails are not counted

    def test_the_look_back_scan_moves_its_minimum_and_its_tile_aggregates() -> None:
        a, u, h0 = _scan_inputs(torch.float32)
        with counting() as counts:
            h = scan_triton(a, u, h0, tiles=Tiles(64, 32, 2, lookback=True))
        read, written = counts["_scan_lookback_kernel"]
        minimum = nbytes(a, u, h0, h)
        assert minimum < read + written <= 1.05 * minimum

    def test_the_lightning_forward_is_counted_per_kernel() -> None:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, 96, 16, generator=g) for _ in range(3))
        with counting() as counts:
            o, _ = lightning_fwd_triton(q, k, v, None, None, 32, torch.float32, torch.float32)
        assert set(counts) == {"_chunk_outer_kernel", "_scan_chunk_kernel", "_chunk_output_kernel"}
        assert counts["_chunk_output_kernel"][1] == nbytes(o)  # the output kernel writes o, once

    def test_the_fused_lightning_forward_moves_its_minimum() -> None:
        """With the GPU's tiles (one value block for a head of 48): q, k, v, the decay and S0 read
        once, o and the final state written once."""
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 80, 48, generator=g) for _ in range(3))
        decay, s0 = torch.rand(1, 2, 80, generator=g), torch.randn(1, 2, 48, 48, generator=g)
        with counting() as counts:
            o, final = gpu_tiles(lightning_fwd_triton)(q, k, v, decay, s0, 64, torch.float32, torch.float32, fused=True)
        assert dict(counts) == {"_fused_forward_kernel": [nbytes(q, k, v, decay, s0), nbytes(o, final)]}

    @pytest.mark.parametrize("with_decay", [False, True])
    def test_the_fused_lightning_backward_stays_near_its_minimum(with_decay: bool) -> None:
        """GPU tiles, one dk and one dv block for heads of 48, chunks of 32 (3 of them for T=80).
        Sweep 1 reads k, v, dO (+ decay, S0) and writes dQ; sweep 2 reads q, k, v, dO (+ decay
        twice, dS) and writes dK, dV (+ the decay gradient) and dS0: k, v and dO are read twice,
        so about 10/7 of the minimum. With a decay, sweep 1 also writes the state entering every
        chunk (float32) and sweep 2 reads it back, for the exact decay gradient."""
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, 2, 80, 48, generator=g) for _ in range(4))
        decay = torch.rand(1, 2, 80, generator=g) if with_decay else None
        s0, ds = (torch.randn(1, 2, 48, 48, generator=g) for _ in range(2))
        with counting() as counts:
            dq, dk, dv, dd, ds0 = gpu_tiles(lightning_bwd_triton)(q, k, v, decay, s0, do, ds, 64, torch.float32,
                                                                  fused=True)
        states = nbytes(s0) * 3 if with_decay else 0  # 3 chunks' entering states
        shifted = 2 * nbytes(decay) - 3 * 2 * 4 if with_decay else 0  # d and d shifted by one step in each chunk
        assert dict(counts) == {
            "_fused_bwd_dq_kernel": [nbytes(k, v, do, decay, s0), nbytes(dq) + states],
            "_fused_bwd_dkv_kernel": [nbytes(q, k, v, do, ds) + shifted + states, nbytes(dk, dv, dd, ds0)],
        }
        minimum = nbytes(q, k, v, do, decay, s0, ds, dq, dk, dv, dd, ds0)
        total = sum(r + w for r, w in counts.values())
        assert total <= (1.8 if with_decay else 1.35) * minimum  # 1.75x and 1.34x
