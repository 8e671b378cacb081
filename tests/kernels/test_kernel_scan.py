"""linear_scan: values vs the per-step loop, autograd vs naive autograd (float64), tracing, errors."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import gradshard.kernels as gk
from gradshard.kernels.scan_torch import scan_naive, scan_torch

F64 = torch.float64


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).norm() / y.norm().clamp_min(1e-300)).item()


def make(batch, length, state=(3, 4), a_shape=None, seed=0, zeros=True):
    g = torch.Generator().manual_seed(seed)
    a_shape = a_shape or (batch, length, *state)
    a = torch.rand(a_shape, generator=g, dtype=F64) * 2 - 1
    if zeros:
        a[a.abs() < 0.1] = 0.0  # exact zeros: no division by cumulative products allowed
    u = torch.randn((batch, length, *state), generator=g, dtype=F64)
    h0 = torch.randn((batch, *state), generator=g, dtype=F64)
    return a, u, h0


def naive_loop(a, u, h0, reverse):
    """Differentiable per-step definition."""
    a = a.expand(a.shape[0], u.shape[1], *a.shape[2:])
    h = torch.zeros_like(u[:, 0]) if h0 is None else h0
    out = [None] * u.shape[1]
    for t in (reversed(range(u.shape[1])) if reverse else range(u.shape[1])):
        h = a[:, t] * h + u[:, t]
        out[t] = h
    return torch.stack(out, 1)


@pytest.mark.parametrize("length", [1, 7, 37, 130])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_h0", [False, True])
def test_forward_matches_loop(length, batch, reverse, with_h0):
    a, u, h0 = make(batch, length)
    h0 = h0 if with_h0 else None
    out = gk.linear_scan(a, u, h0, reverse=reverse)
    assert out.shape == u.shape and out.dtype == F64
    assert rel(out, scan_naive(a, u, h0, reverse)) <= 1e-12


@pytest.mark.parametrize("a_shape", [(3, 37, 2, 1, 1), (1, 37, 2, 5, 4), (3, 1, 2, 5, 4), (1, 1, 1, 5, 1)])
@pytest.mark.parametrize("reverse", [False, True])
def test_broadcast_coefficients(a_shape, reverse):
    a, u, h0 = make(3, 37, state=(2, 5, 4), a_shape=a_shape)
    assert rel(gk.linear_scan(a, u, h0, reverse=reverse), naive_loop(a, u, h0, reverse)) <= 1e-12


@pytest.mark.parametrize("chunk", [1, 2, 5, 36, 37, 100])
@pytest.mark.parametrize("reverse", [False, True])
def test_every_chunking_is_exact(chunk, reverse):
    a, u, h0 = make(2, 37, state=(3,))
    assert rel(scan_torch(a, u, h0, reverse=reverse, chunk=chunk), scan_naive(a, u, h0, reverse)) <= 1e-12


def test_long_sequence_with_tiny_coefficients_is_exact():
    a, u, h0 = make(2, 5003, state=(3,), zeros=False)
    a = a * 1e-3  # products underflow quickly: a cumprod-divide scheme would produce inf/nan
    a[:, ::97] = 0.0
    out = gk.linear_scan(a, u, h0)
    assert torch.isfinite(out).all()
    assert rel(out, scan_naive(a, u, h0)) <= 1e-12


@pytest.mark.parametrize("reverse", [False, True])
def test_per_head_coefficients_take_the_fixup_form_exactly(reverse, monkeypatch):
    """``a`` a quarter of ``u``'s size: chunks are fixed up by running products of ``a`` in one op
    (module doc); tiny and zero coefficients underflow those products as the recurrence does."""
    calls = []
    fixup = scan_torch.__globals__["_scan_chunks_fixup"]
    monkeypatch.setitem(scan_torch.__globals__, "_scan_chunks_fixup", lambda *args: calls.append(1) or fixup(*args))
    a, u, h0 = make(2, 5003, state=(3, 4), a_shape=(2, 5003, 3, 1), zeros=False)
    a = a * 1e-3
    a[:, ::97] = 0.0
    out = scan_torch(a, u, h0, reverse=reverse, compiled=False)  # the torch ops, not the compiled CPU loop
    assert calls
    assert torch.isfinite(out).all()
    assert rel(out, scan_naive(a, u, h0, reverse)) <= 1e-12


@pytest.mark.parametrize("length", [1, 7, 37])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("a_shape", ["full", "per_head"])
def test_gradients_match_naive_autograd(length, batch, reverse, a_shape):
    shape = None if a_shape == "full" else (batch, length, 3, 1)
    a, u, h0 = make(batch, length, a_shape=shape)
    for t in (a, u, h0):
        t.requires_grad_(True)
    g = torch.randn(u.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((gk.linear_scan(a, u, h0, reverse=reverse) * g).sum(), (a, u, h0))
    ref = torch.autograd.grad((naive_loop(a, u, h0, reverse) * g).sum(), (a, u, h0))
    for x, y in zip(got, ref):
        assert x.shape == y.shape
        assert rel(x, y) <= 1e-10


def test_gradients_without_h0_and_partial_requires_grad():
    a, u, _ = make(3, 37)
    u.requires_grad_(True)
    (du,) = torch.autograd.grad(gk.linear_scan(a, u).square().sum(), (u,))
    u2 = u.detach().clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(naive_loop(a, u2, None, False).square().sum(), (u2,))
    assert rel(du, ref) <= 1e-10


def test_double_backward():
    a, u, h0 = make(2, 7, state=(2,))
    for t in (a, u, h0):
        t.requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda a, u, h0: gk.linear_scan(a, u, h0, reverse=True), (a, u, h0))


def test_final_state_and_sharding():
    a, u, h0 = make(3, 37)
    h, last = gk.linear_scan(a, u, h0, return_final_state=True)
    assert torch.equal(last, h[:, -1])
    h1, s1 = gk.linear_scan(a[:, :20], u[:, :20], h0, return_final_state=True)
    h2 = gk.linear_scan(a[:, 20:], u[:, 20:], s1)
    assert rel(torch.cat([h1, h2], 1), h) <= 1e-12
    hr, first = gk.linear_scan(a, u, h0, reverse=True, return_final_state=True)
    assert torch.equal(first, hr[:, 0])
    empty, s = gk.linear_scan(a[:, :0], u[:, :0], h0, return_final_state=True)
    assert empty.shape == (3, 0, 3, 4) and torch.equal(s, h0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_half_precision_accumulates_in_float32(dtype):
    a, u, h0 = make(2, 2000, state=(8,), zeros=False)
    a = 0.999 + 0.001 * a.abs()  # long memory: low-precision accumulation would drift
    a_l, u_l, h_l = a.to(dtype), u.to(dtype), h0.to(dtype)
    out = gk.linear_scan(a_l, u_l, h_l)
    assert out.dtype == dtype
    ref = scan_naive(a_l.double(), u_l.double(), h_l.double())
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps  # ~rounding of the output
    assert rel(out.double(), ref) <= tol
    if dtype != torch.float32:  # the test discriminates: accumulating in `dtype` drifts far more
        h = h_l
        for t in range(u_l.shape[1]):
            h = a_l[:, t] * h + u_l[:, t]
        assert rel(h.double(), ref[:, -1]) > 4 * tol


def test_trace_records_one_custom_op():
    a, u, h0 = make(2, 7)

    def f(a, u, h0):
        return gk.linear_scan(a.sigmoid(), u, h0, reverse=True).sum()

    gm = make_fx(f, pre_dispatch=True)(a, u, h0)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.gradshard.linear_scan.default) == 1
    assert not any("addcmul" in str(t) or "cumprod" in str(t) for t in targets)
    gm2 = make_fx(lambda a, u: gk.linear_scan(a, u), pre_dispatch=True)(a, u)
    node = next(n for n in gm2.graph.nodes if n.target == torch.ops.gradshard.linear_scan.default)
    assert node.args[2] is None  # optional h0 goes through the schema as None
    assert torch.allclose(gm(a, u, h0), f(a, u, h0))


def test_clear_errors():
    a, u, h0 = make(2, 7)
    with pytest.raises(ValueError, match="as many dims"):
        gk.linear_scan(a[..., 0], u)
    with pytest.raises(ValueError, match="does not broadcast"):
        gk.linear_scan(a[:, :, :2], u)
    with pytest.raises(ValueError, match="h0 must be"):
        gk.linear_scan(a, u, h0[:1])
    with pytest.raises(ValueError, match="unknown backend"):
        gk.linear_scan(a, u, backend="cuda")
    with pytest.raises(TypeError, match="floating point"):
        gk.linear_scan(a, u.long())
