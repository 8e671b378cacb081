"""plan="truncated_adjoint": the windowed adjoint of docs/DESIGN.md, in O(T), equal to adjoint for W >= T.

Reference semantics: every h_t recomputed from a detached h_{t-W} (from h0 itself, not
detached, when t - W < 0); autograd through that reference gives the expected gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from gradshard.plans.adjoint import truncated as truncated_module
from gradshard.plans.adjoint.truncated import StepTruncation, truncated_lambda

from .helpers import assert_same_grads
from .models import (DenseLoopSSM, DiagonalSSM, init_like_training, truncated_dense_reference,
                     truncated_scan_reference)


def brute_lambda(a, g, W, dense=False):
    T = g.shape[1]
    lam = torch.zeros_like(g)
    for i in range(T):
        for t in range(i, min(i + W, T)):
            v = g[:, t]
            for j in range(t, i, -1):
                v = a[:, j].transpose(-1, -2) @ v if dense else a[:, j] * v
            lam[:, i] += v
    return lam


@settings(max_examples=60, deadline=None)
@given(T=st.integers(1, 17), W=st.integers(1, 20), shard=st.integers(1, 18), seed=st.integers(0, 2**16),
       broadcast=st.booleans(), via_scan=st.booleans())
def test_sweep_matches_brute_force(T, W, shard, seed, broadcast, via_scan):
    """``via_scan``: the blocks' cumulative products and sums by the masked scan (large tensors)
    instead of ``torch.cumprod`` / ``cumsum`` (small ones)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(2, T, 3, 1 if broadcast else 2, generator=g, dtype=torch.float64)
    grad = torch.randn(2, T, 3, 2, generator=g, dtype=torch.float64)
    want = brute_lambda(a.expand_as(grad), grad, W)
    limit = truncated_module._TORCH_CUMULATIVE_MAX
    truncated_module._TORCH_CUMULATIVE_MAX = 0 if via_scan else limit
    try:
        got = truncated_lambda(a, grad, W, shard_size=shard)
        got_unit = truncated_lambda(None, grad, W, shard_size=shard)
    finally:
        truncated_module._TORCH_CUMULATIVE_MAX = limit
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_unit, brute_lambda(torch.ones_like(grad), grad, W), rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 11), W=st.integers(1, 13), shard=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_dense_sweep_matches_brute_force(T, W, shard, seed):
    g = torch.Generator().manual_seed(seed)
    A = 0.5 * torch.randn(2, T, 3, 3, generator=g, dtype=torch.float64)
    grad = torch.randn(2, T, 3, 2, generator=g, dtype=torch.float64)
    torch.testing.assert_close(truncated_lambda(A, grad, W, kind="dense", shard_size=shard),
                               brute_lambda(A, grad, W, dense=True), rtol=1e-11, atol=1e-11)


def test_unit_decay_and_tiny_decays():
    """a = 1 (cumsum) and decays ~1e-300 (no division by cumulative products)."""
    grad = torch.randn(1, 9, 2, dtype=torch.float64)
    torch.testing.assert_close(truncated_lambda(None, grad, 4, shard_size=2),
                               brute_lambda(torch.ones_like(grad), grad, 4))
    a = torch.full((1, 9, 2), 1e-300, dtype=torch.float64)
    a[:, ::3] = 0.0
    got = truncated_lambda(a, grad, 5, shard_size=4)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, brute_lambda(a, grad, 5))


class _ElementsWritten(TorchDispatchMode):
    """Counts the elements every op writes."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.elements += sum(t.numel() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("via_scan", [False, True])
def test_work_is_linear_in_T_for_any_window(via_scan):
    """Every R and P value is computed once: whatever W, the elements written are at most twice
    what the exact adjoint writes (R, P g, the corrected g besides the sweep), not O(T*W)."""
    T, shard, state = 512, 16, (2, 8)
    grad = torch.randn(1, T, *state, dtype=torch.float64)
    a = torch.rand(1, T, state[0], 1, dtype=torch.float64)
    limit = truncated_module._TORCH_CUMULATIVE_MAX
    truncated_module._TORCH_CUMULATIVE_MAX = 0 if via_scan else limit
    written = {}
    try:
        for W in (4, 64, 256, T):
            with _ElementsWritten() as mode:
                truncated_lambda(a, grad, W, shard_size=shard)
            written[W] = mode.elements
    finally:
        truncated_module._TORCH_CUMULATIVE_MAX = limit
    exact = written.pop(T)  # W >= T: the exact adjoint's reverse scan, nothing else
    assert max(written.values()) <= 2 * exact, (written, exact)


def test_shards_must_come_right_to_left():
    sweep = StepTruncation("diagonal", 3, 10)
    with pytest.raises(RuntimeError, match="does not end"):
        sweep.correct(0, None, torch.zeros(1, 4, 2))


def _pair(W: int, **kw):
    model = init_like_training(DiagonalSSM(scan="gradshard", **kw))
    ref = copy.deepcopy(model)
    ref.scan_fn = truncated_scan_reference(W)
    return model, ref


@pytest.mark.parametrize("W,shard", [(1, 4), (3, 4), (4, 3), (5, 2), (6, 11)])
def test_model_matches_detached_reference(W, shard):
    model, ref = _pair(W, conv=True, h0=True)
    x = torch.randn(3, 11, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(W))
    assert_same_grads(model, (x,), plan="truncated_adjoint", reference=ref, window=W, shard_size=shard)


@pytest.mark.parametrize("W", [11, 12, 100])
def test_window_at_least_T_is_the_exact_adjoint(W):
    model = init_like_training(DiagonalSSM(scan="loop", h0=True))
    x = torch.randn(1, 11, 6, dtype=torch.float64)
    assert_same_grads(model, (x,), plan="truncated_adjoint", window=W, shard_size=4)


@pytest.mark.parametrize("W,shard", [(2, 3), (4, 5)])
def test_dense_model_matches_detached_reference(W, shard):
    model = init_like_training(DenseLoopSSM(h0=True))
    ref = copy.deepcopy(model)
    ref.scan_fn = truncated_dense_reference(W)
    x = torch.randn(2, 9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert_same_grads(model, (x,), plan="truncated_adjoint", reference=ref, window=W, shard_size=shard)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(2, 10), W=st.integers(1, 12), shard=st.integers(1, 11))
def test_property_model_over_T_W_shard(T, W, shard):
    model, ref = _pair(W, h0=True)
    x = torch.randn(2, T, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(T * 31 + W))
    assert_same_grads(model, (x,), plan="truncated_adjoint", reference=ref, window=W, shard_size=shard)


@pytest.mark.parametrize("shard", [1, 3, 5])
def test_chunked_window_products_with_zeros_and_signs(shard):
    """ChunkedTruncation's kappa_i = prod_{j=i+1}^{i+W} a_j from suffix sums of log|a|, zeros and
    signs (O(shard) per shard for any W): equal to the products, zero where a window holds a zero,
    negative where it holds an odd count of negative decays; the final state's factor too."""
    from gradshard.plans.adjoint.truncated import ChunkedTruncation

    T, W = 23, 5
    g = torch.Generator().manual_seed(shard)
    a = torch.rand(2, T, 3, generator=g, dtype=torch.float64) * 2 - 1
    a[:, 7, 1] = 0.0
    q, dy = torch.randn(2, T, 3, 4, generator=g, dtype=torch.float64), torch.randn(2, T, 3, 6, generator=g,
                                                                                 dtype=torch.float64)
    kappa = torch.stack([a[:, i + 1:i + W + 1].prod(1) for i in range(T)], 1)  # windows past T unused
    window = ChunkedTruncation(W, T)
    bounds = [(s, min(s + shard, T)) for s in range(0, T, shard)]
    for s, e in reversed(bounds):
        if window.corrects(s):
            n = min(e + W, T) - (s + W)
            want = torch.zeros(2, e - s, 3, 6, dtype=torch.float64)
            want[:, :n] = -kappa[:, s:s + n, :, None] * dy[:, s + W:s + W + n]
            torch.testing.assert_close(window.y2_cotangent(s, e, a[:, s:e]), want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(window.query_next(s, e)[:, :n], q[:, s + W:s + W + n])
        if e == T - W:
            d_final = torch.randn(2, 3, 6, 4, dtype=torch.float64)
            torch.testing.assert_close(window.final_correction(d_final),
                                       -a[:, T - W:].prod(1)[..., None, None] * d_final, rtol=1e-12, atol=1e-12)
        window.keep(s, q[:, s:e], a[:, s:e], dy[:, s:e])
    assert (kappa[:, 2:7, 1] == 0).all()  # the zero reached those windows
