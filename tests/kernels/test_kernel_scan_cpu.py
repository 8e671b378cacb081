"""The compiled CPU scan (gradshard.kernels.scan_cpu): the naive loop to the last bit, for every
broadcast of ``a`` (without expanding it where its state dims are one run), both directions,
with and without ``h0``, half inputs accumulated in float32; disabled or unbuildable, the torch
ops run."""

import pytest
import torch

import gradshard.kernels.scan_cpu as scan_cpu_module
from gradshard.kernels.scan_cpu import scan_cpu
from gradshard.kernels.scan_torch import scan_naive, scan_torch



def _inputs(a_shape, state, dtype=torch.float64, batch=3, length=37):
    g = torch.Generator().manual_seed(len(a_shape) * 7 + length)
    a = torch.rand(a_shape, generator=g, dtype=torch.float64) * 2 - 1
    a[a.abs() < 0.1] = 0.0  # zeros and both signs: no division, no log
    u = torch.randn((batch, length, *state), generator=g, dtype=torch.float64)
    h0 = torch.randn((batch, *state), generator=g, dtype=torch.float64)
    return a.to(dtype), u.to(dtype), h0.to(dtype)


@pytest.mark.parametrize("a_shape, state", [
    ((3, 37, 2, 5, 4), (2, 5, 4)),  # per element
    ((3, 37, 2, 1, 1), (2, 5, 4)),  # per head (Mamba-2)
    ((3, 37, 2, 5, 1), (2, 5, 4)),  # per channel, broadcast over the state (Mamba-1)
    ((1, 1, 1, 5, 1), (2, 5, 4)),  # no batch or time axis, leading and trailing broadcast
    ((3, 37, 1, 1, 4), (2, 5, 4)),  # per state column only
    ((3, 37, 2, 1, 4), (2, 5, 4)),  # a gap in the run: expanded
    ((3, 37, 1, 1, 1), (2, 5, 4)),  # one scalar per step
    ((3, 37), ()),  # no state dims
    ((3, 37, 6), (6,)),
])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_h0", [False, True])
def test_the_compiled_loop_is_the_naive_loop(a_shape, state, reverse, with_h0):
    a, u, h0 = _inputs(a_shape, state)
    h0 = h0 if with_h0 else None
    out = scan_cpu(a, u, h0, reverse, torch.float64, torch.float64)
    assert out is not None and out.shape == u.shape and out.dtype == torch.float64
    assert torch.equal(out, scan_naive(a, u, h0, reverse))


def test_half_inputs_accumulate_in_float32_and_return_the_asked_dtype():
    a, u, h0 = _inputs((3, 37, 2, 1, 1), (2, 5, 4), dtype=torch.bfloat16)
    out = scan_cpu(a, u, h0, False, torch.bfloat16, torch.float32)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, scan_naive(a, u, h0, False).to(torch.bfloat16))


def test_long_threaded_rows_and_non_contiguous_inputs():
    """Enough work for the OpenMP blocks (several per batch row), inputs that are strided views."""
    g = torch.Generator().manual_seed(0)
    a = torch.rand(2, 1000, 600, generator=g, dtype=torch.float64)[:, ::2]
    u = torch.randn(2, 600, 500, generator=g, dtype=torch.float64).transpose(1, 2)
    assert not a.is_contiguous() and not u.is_contiguous()
    assert torch.equal(scan_torch(a, u, reverse=True), scan_naive(a, u, None, True))


def test_disabled_or_unbuildable_runs_the_torch_ops(monkeypatch):
    a, u, h0 = _inputs((3, 37, 2, 1, 1), (2, 5, 4))
    monkeypatch.setenv("GRADSHARD_CPU_SCAN", "0")
    assert scan_cpu(a, u, h0, False, torch.float64, torch.float64) is None
    monkeypatch.delenv("GRADSHARD_CPU_SCAN")
    monkeypatch.setattr(scan_cpu_module, "_kernels", {})
    monkeypatch.setattr(scan_cpu_module, "_failed", "no compiler")
    assert scan_cpu(a, u, h0, False, torch.float64, torch.float64) is None
    assert (scan_torch(a, u, h0) - scan_naive(a, u, h0, False)).abs().max() < 1e-12
