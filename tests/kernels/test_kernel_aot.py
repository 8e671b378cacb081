"""Ahead-of-time compile of the Triton kernels for sm_80 / sm_90 on this CPU-only machine.

The launchers run on CPU tensors with launches intercepted; the recorded launches compile to
cubins with Triton's bundled ptxas. This checks what the interpreter cannot: that the kernels
compile for a GPU and fit its shared memory, with little or no register spilling.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from tests.interpreted import INTERPRETED  # noqa: E402

pytestmark = pytest.mark.skipif(INTERPRETED, reason="compiles the kernels; runs without TRITON_INTERPRET")

if not INTERPRETED:
    from triton.runtime.jit import JITFunction

    from gradshard.kernels.triton import layout
    from gradshard.kernels.triton.adjoint import adjoint_shard_triton
    from gradshard.kernels.triton.aot import SM_LIMITS, compile_launch, record_launches
    from gradshard.kernels.triton.lightning import lightning_bwd_triton, lightning_fwd_triton
    from gradshard.kernels.triton.scan import scan_triton


def _e(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _names(launches) -> list[str]:
    return [launch.name for launch in launches]


def test_lightning_launchers_are_chunk_parallel():
    """Forward: increments, chunk scan, outputs; backward adds the reverse scan and the dQ/dK,
    dV and (with a decay) decay-gradient kernels. Every per-chunk kernel's grid has one program
    per chunk and head (not one per head); float32 chunks are 32 steps (64 spill on sm_90)."""
    b, h, length, d = 2, 3, 1000, 64
    with record_launches() as fwd:
        lightning_fwd_triton(_e(b, h, length, d), _e(b, h, length, d), _e(b, h, length, d), _e(b, h, length),
                             _e(b, h, d, d), 64, torch.float32, torch.float32)
    assert _names(fwd) == ["_chunk_outer_kernel", "_scan_chunk_kernel", "_chunk_output_kernel"]
    assert fwd[0].grid[:2] == (32, b * h) and fwd[2].grid[:2] == (32, b * h)
    with record_launches() as bwd:
        lightning_bwd_triton(*(_e(b, h, length, d),) * 3, None, None, _e(b, h, length, d), None, 64, torch.float32)
    assert _names(bwd) == ["_chunk_outer_kernel", "_scan_chunk_kernel"] * 2 + ["_chunk_grad_qk_kernel",
                                                                                "_chunk_grad_v_kernel"]
    assert bwd[1].constexprs["REVERSE"] is False and bwd[3].constexprs["REVERSE"] is True
    assert bwd[4].grid == (32, b * h) and bwd[5].grid == (32, b * h, 1)
    with record_launches() as with_decay:
        lightning_bwd_triton(*(_e(b, h, length, d),) * 3, _e(b, h, length), None, _e(b, h, length, d), None, 64,
                             torch.float32)
    assert _names(with_decay)[-1] == "_chunk_grad_decay_kernel"
    assert with_decay[-1].grid == (32, b * h, d // 16)  # 16-value programs, their shares summed after


def test_recording_restores_the_launch_path_even_on_error():
    with pytest.raises(ZeroDivisionError):
        with record_launches():
            assert layout.RECORDING_LAUNCHES.get()
            1 / 0
    assert not layout.RECORDING_LAUNCHES.get()
    assert JITFunction.run.__name__ == "run"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        scan_triton(_e(1, 4, 2), _e(1, 4, 2), None)  # CPU tensors, compiled kernels, not recording


def test_chunked_scan_records_summary_recursion_and_final_pass():
    with record_launches() as launches:
        scan_triton(_e(1, 4096, 64), _e(1, 4096, 64), _e(1, 64), chunk=256)
    flags = [(la.constexprs["SUMMARY"], la.constexprs["HAS_CARRY"]) for la in launches]
    assert flags == [(True, False), (False, True), (False, True)]  # summaries, 16-chunk scan, final
    assert launches[0].grid == (2, 16, 1)  # 64 channels in 32-wide tiles, 16 chunks, 1 row


@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_fit_shared_memory_and_do_not_spill(arch):
    """One variant per kernel at training shapes (bf16, d=128 heads: the largest tiles; the fused
    forward with a state in): each
    compiles, fits the SM's shared memory and keeps every value in registers (no local memory)."""
    b, h, length, d = 2, 4, 4096, 128
    bf = torch.bfloat16
    with record_launches() as launches:
        scan_triton(_e(2, length, 256, 16, dtype=bf), _e(2, length, 256, 16, dtype=bf), None, reverse=True)
        adjoint_shard_triton(*(_e(2, 1024, 512, dtype=bf),) * 3, None, _e(2, 512, dtype=bf), out_dtypes=(bf,) * 3)
        lightning_fwd_triton(*(_e(b, h, length, d, dtype=bf),) * 3, _e(b, h, length), None, 64, bf, torch.float32)
        lightning_fwd_triton(*(_e(b, h, length, d, dtype=bf),) * 3, _e(b, h, length), _e(b, h, d, d), 64, bf,
                             torch.float32, fused=True)
        lightning_bwd_triton(*(_e(b, h, length, d, dtype=bf),) * 3, _e(b, h, length), None,
                             _e(b, h, length, d, dtype=bf), None, 64, torch.float32)
    wanted = {"_scan_chunk_kernel", "_adjoint_shard_kernel", "_chunk_outer_kernel", "_chunk_output_kernel",
              "_fused_forward_kernel", "_chunk_grad_qk_kernel", "_chunk_grad_v_kernel", "_chunk_grad_decay_kernel"}
    picked = {}
    for launch in launches:
        picked.setdefault(launch.name, launch)
    assert set(picked) == wanted
    for launch in picked.values():
        got = compile_launch(launch, arch)
        assert got.registers > 0 and got.ptx_lines > 100, got
        assert got.shared_bytes <= SM_LIMITS[arch]["shared_per_block"], got
        assert got.spill_bytes == 0, got
        assert 0 < got.occupancy <= 1, got


def test_the_fused_lightning_backward_records_two_sweeps():
    """fused=True: the dQ sweep (a program per head and 64-wide dk block, every value) and the
    dK/dV sweep (a program per head and 64-wide dv block, every key); nothing else runs for
    heads of 64. The chooser never picks it for CPU tensors."""
    b, h, length, d = 2, 3, 1000, 64
    args = (*(_e(b, h, length, d),) * 3, _e(b, h, length), _e(b, h, d, d), _e(b, h, length, d), _e(b, h, d, d), 64,
            torch.float32)
    with record_launches() as fused:
        lightning_bwd_triton(*args, fused=True)
    assert _names(fused) == ["_fused_bwd_dq_kernel", "_fused_bwd_dkv_kernel"]
    assert fused[0].grid == (b * h, 1) and fused[1].grid == (b * h, 1)
    assert fused[0].constexprs["STORE_STATES"] is True and fused[1].constexprs["BC"] == 32
    with record_launches() as chosen:
        lightning_bwd_triton(*args)
    assert "_fused_bwd_dq_kernel" not in _names(chosen)


# sm_80 (17 s) runs in `make test-all`: the default suite stays under 15 min; sm_90 is where it is picked
@pytest.mark.parametrize("arch", [pytest.param(80, marks=pytest.mark.slow), 90])
def test_the_fused_lightning_backward_compiles_and_fits_shared_memory(arch):
    """bfloat16 heads of 64 and 128, with and without a decay (S0 and dS_final given): every
    variant compiles and fits the SM's shared memory. On sm_90 the bfloat16 d=64 dQ sweep and
    the d=64 dK/dV sweep without a decay keep every value in registers; the other variants
    spill (kernels/triton/lightning_fused.py, ``fused_backward_tiles``)."""
    bf = torch.bfloat16
    spill_free = set()
    for d in (64, 128):
        for decay in (True, False):
            b, h, length = 2, 4, 1024
            with record_launches() as launches:
                lightning_bwd_triton(*(_e(b, h, length, d, dtype=bf),) * 3, _e(b, h, length) if decay else None,
                                     _e(b, h, d, d), _e(b, h, length, d, dtype=bf), _e(b, h, d, d), 64, torch.float32,
                                     fused=True)
            for launch in launches:
                got = compile_launch(launch, arch)
                assert got.registers > 0 and got.shared_bytes <= SM_LIMITS[arch]["shared_per_block"], got
                if got.spill_bytes == 0:
                    spill_free.add((launch.name, d, decay))
    if arch == 90:
        assert {("_fused_bwd_dq_kernel", 64, True), ("_fused_bwd_dq_kernel", 64, False),
                ("_fused_bwd_dkv_kernel", 64, False)} <= spill_free
