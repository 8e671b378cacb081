"""Chunked shards: an outer-product state read by a contraction (SSD, decayed linear attention)
runs each adjoint shard in block form, exact, without forming per-step states."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import gradshard as gs
from gradshard.kernels import linear_scan
from gradshard.kernels.ssd_torch import ssd_chunk_scan

from .helpers import assert_same_grads, rel_err
from .models import SsdLayer, SsdNet, truncated_scan_reference

F64 = torch.float64


def _scan_reference(z, x, B, C, h0):
    h = linear_scan(torch.exp(z)[..., None, None], x[..., None] * B[..., None, :], h0)
    return torch.einsum("blhpn,blhn->blhp", h, C), h[:, -1]


@settings(max_examples=12, deadline=None)
@given(T=st.integers(1, 40), chunk=st.sampled_from([1, 4, 16]), with_h0=st.booleans(),
       strength=st.sampled_from([0.1, 3.0, 80.0]))
def test_ssd_block_form_equals_the_scan_values_and_gradients(T, chunk, with_h0, strength):
    """Odd lengths (padded blocks), one-step blocks, an initial state, decays that underflow to 0."""
    g = torch.Generator().manual_seed(T * 7 + chunk)
    b, H, P, N = 2, 3, 4, 5
    z = (-strength * torch.rand(b, T, H, generator=g, dtype=F64)).requires_grad_()
    x, B, C = (torch.randn(b, T, H, d, generator=g, dtype=F64).requires_grad_() for d in (P, N, N))
    h0 = torch.randn(b, H, P, N, generator=g, dtype=F64).requires_grad_() if with_h0 else None
    ins = [t for t in (z, x, B, C, h0) if t is not None]
    y, hT = ssd_chunk_scan(z, x, B, C, h0, chunk)
    y_ref, hT_ref = _scan_reference(z, x, B, C, h0)
    assert rel_err(y, y_ref) < 1e-12 and rel_err(hT, hT_ref) < 1e-12
    gy, gh = torch.randn_like(y), torch.randn_like(hT)
    got = torch.autograd.grad((y, hT), ins, (gy, gh))
    want = torch.autograd.grad((y_ref, hT_ref), ins, (gy, gh))
    # relative to the gradients' scale: with decays near underflow a gradient can be a difference of
    # O(1) terms far below them (dz ~ 1e-6 here), exact to rounding of those terms only
    scale = 1e-4 * max(r.norm().item() for r in want)
    for a, r in zip(got, want):
        assert torch.isfinite(a).all() and rel_err(a, r, floor=scale) < 1e-11


class StateWatch(TorchDispatchMode):
    """Records the largest tensor an op returns whose trailing dims are a (heads, P, N) state."""

    def __init__(self, state: tuple[int, int, int]) -> None:
        super().__init__()
        self.state, self.most_steps = state, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == 5 and tuple(t.shape[2:]) == self.state:
                self.most_steps = max(self.most_steps, int(t.shape[1]))
        return out


@pytest.mark.parametrize("decay,learn_h0,layout", [
    ("exp", False, "pn"), ("exp", True, "pn"), ("sigmoid", False, "pn"),  # Mamba-2's SSD
    ("const", True, "kv"), ("sigmoid", False, "kv"),  # linear attention (MiniMax, RetNet): q S, S = k^T v
])
def test_outer_product_regions_run_chunked_and_match_autograd(decay, learn_h0, layout):
    torch.manual_seed(0)
    model = SsdNet(decay=decay, learn_h0=learn_h0, layout=layout).double()
    x = torch.randn(2, 37, 6, dtype=F64)
    cm = assert_same_grads(model, (x,), shard_size=8)
    regions = [m for m in cm.graph.modules() if hasattr(m, "chunked")]
    assert len(regions) == 2 and all(r.chunked is not None for r in regions)
    assert all(r.chunked.log_decay == (decay != "sigmoid") for r in regions)
    assert all(r.chunked.contracted == (-1 if layout == "pn" else -2) for r in regions)
    assert "shards run chunked" in cm.explain()
    # no per-step states, forward or backward: only the few blocks' states of one shard
    watch = StateWatch((3, 4, 5) if layout == "pn" else (3, 5, 4))
    with watch:
        cm(x.requires_grad_()).square().sum().backward()
    assert 0 < watch.most_steps <= 2


def test_per_step_form_on_request_forms_states_and_agrees():
    torch.manual_seed(1)
    model = SsdNet().double()
    x = torch.randn(2, 29, 6, dtype=F64)
    cm = assert_same_grads(model, (x,), shard_size=8, chunked=False)
    assert all(m.chunked is None for m in cm.graph.modules() if hasattr(m, "chunked"))
    watch = StateWatch((3, 4, 5))
    with watch:
        cm(x).square().sum().backward()
    assert watch.most_steps >= 8  # a shard's per-step states


def _truncated_reference(model: torch.nn.Module, window: int) -> torch.nn.Module:
    """A copy of ``model`` whose scans recompute every ``h_t`` from a detached ``h_{t-W}`` (the
    windowed gradient's reference semantics); same parameters and names."""
    ref = copy.deepcopy(model)
    base, scan = type(model), truncated_scan_reference(window)

    class Windowed(base):
        def forward(self, *args):
            original = gs.kernels.linear_scan
            gs.kernels.linear_scan = lambda a, u, h0=None, **_: scan(a, u, h0)
            try:
                return base.forward(self, *args)
            finally:
                gs.kernels.linear_scan = original

    ref.__class__ = Windowed
    return ref


@pytest.mark.parametrize("decay", ["exp", "sigmoid"])  # SSD's block form; the lightning op
def test_truncated_adjoint_runs_chunked_shards_at_every_length(decay):
    """window >= T is the exact adjoint; a shorter window is the exact VJP of the block form with a
    second readout of the states (ChunkedTruncation): equal to the windowed reference (every h_t
    from a detached h_{t-W}) on odd lengths, windows that do not divide T, shards longer than the
    window (cut to it) and shorter ones, never forming a shard's per-step states."""
    torch.manual_seed(2)
    model = SsdNet(decay=decay).double()
    x = torch.randn(1, 21, 6, dtype=F64)
    cm = assert_same_grads(model, (x,), plan="truncated_adjoint", shard_size=8, window=64)
    regions = [m for m in cm.graph.modules() if hasattr(m, "chunked")]
    assert regions and all(r.chunked is not None and r.chunked_at(65) for r in regions)
    assert "second readout" in cm.explain()
    for T, window, shard in [(21, 6, 8), (37, 10, 4), (33, 13, 16)]:
        torch.manual_seed(5)
        model = SsdNet(decay=decay).double()
        x = torch.randn(2, T, 6, dtype=F64)
        cm = assert_same_grads(model, (x,), plan="truncated_adjoint", reference=_truncated_reference(model, window),
                               shard_size=shard, window=window)
        (region, *_) = [m for m in cm.graph.modules() if hasattr(m, "chunked")]
        assert max(e - s for s, e in region.shards(T)) == min(shard, window)
        watch = StateWatch((3, 4, 5))
        with watch:
            cm(x.requires_grad_()).square().sum().backward()
        assert 0 < watch.most_steps <= 2, (T, window, shard)


@pytest.mark.parametrize("decay, layout", [("exp", "pn"), ("const", "kv"), ("sigmoid", "kv")])
def test_truncated_chunked_shards_window_the_initial_and_final_states(decay, layout):
    """A learned initial state gets the gradient of the first W steps only; the final state's
    gradient (a full-state gradient at the last step, not a readout's) is windowed by a shard
    boundary at T-1-W, where its correction enters."""
    torch.manual_seed(6)
    model = SsdLayer(decay=decay, layout=layout, learn_h0=True, final_state=True).double()
    x = torch.randn(2, 29, 6, dtype=F64)
    cm = assert_same_grads(model, (x,), plan="truncated_adjoint", reference=_truncated_reference(model, 9),
                           shard_size=4, window=9)
    (region,) = [m for m in cm.graph.modules() if hasattr(m, "chunked")]
    assert region.chunked is not None and (29 - 9) in [e for _, e in region.shards(29)]


def test_chunked_regions_recompute_layer_inputs_from_the_region_before():
    """A chained input's window is the region before rerun from its checkpoints -- in block form."""
    torch.manual_seed(3)
    model = SsdNet(layers=3).double()
    x = torch.randn(2, 30, 6, dtype=F64)
    cm = assert_same_grads(model, (x,), shard_size=8, recompute_layer_inputs=True)
    regions = [m for m in cm.graph.modules() if hasattr(m, "chunked")]
    assert all(r.chunked is not None for r in regions) and any(r.chained for r in regions)


def test_the_final_state_gradient_enters_the_last_shard():
    torch.manual_seed(4)
    model = SsdLayer(final_state=True).double()
    cm = assert_same_grads(model, (torch.randn(2, 21, 6, dtype=F64),), shard_size=8)
    (region,) = [m for m in cm.graph.modules() if hasattr(m, "chunked")]
    assert region.chunked is not None and region.io.final_state


@pytest.mark.parametrize("decay", ["exp", "sigmoid"])  # SSD's block form; the lightning op
def test_the_program_counts_the_block_form_flops(decay):
    """explain()'s stages price a chunked region's block form (counted on meta tensors), not the
    per-step scan and contraction it replaces: within 10% of the FLOPs a step runs (the per-step
    pricing read 0.47x on these shapes)."""
    import gradshard as gs

    torch.manual_seed(0)
    model = SsdNet(decay=decay).double()
    x = torch.randn(2, 61, 6, dtype=F64)
    cm = gs.compile(model, plan="adjoint", shard_size=16)
    step = lambda: cm(x).square().sum().backward()  # noqa: E731
    step()
    measured = gs.measure(step).flops
    assert abs(cm.program.total_flops / measured - 1) < 0.1, (cm.program.total_flops, measured)
