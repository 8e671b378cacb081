"""lightning_attention: values and gradients vs the per-step recurrence (float64), LASP chaining, tracing."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import gradshard.kernels as gk
from gradshard.kernels.lightning_torch import lightning_naive

F64 = torch.float64


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).norm() / y.norm().clamp_min(1e-300)).item()


def make(batch, heads, length, dk=4, dv=5, decay="steps", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, length, dk, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(batch, heads, length, dv, generator=g, dtype=F64)
    s0 = torch.randn(batch, heads, dk, dv, generator=g, dtype=F64)
    if decay == "none":
        d = None
    elif decay == "head":
        d = 0.5 + 0.5 * torch.rand(heads, generator=g, dtype=F64)
    else:
        d = 0.3 + 0.7 * torch.rand(batch, heads, length, generator=g, dtype=F64)
    return q, k, v, d, s0


@pytest.mark.parametrize("length", [1, 7, 37, 130])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("decay", ["none", "head", "steps"])
@pytest.mark.parametrize("with_s0", [False, True])
def test_forward_matches_recurrence(length, batch, decay, with_s0):
    q, k, v, d, s0 = make(batch, 2, length, decay=decay)
    s0 = s0 if with_s0 else None
    o, s = gk.lightning_attention(q, k, v, d, initial_state=s0, chunk_size=16)
    o_ref, s_ref = lightning_naive(q, k, v, d, s0)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert rel(o, o_ref) <= 1e-12 and rel(s, s_ref) <= 1e-12


@pytest.mark.parametrize("chunk", [1, 5, 16, 64, 200])
def test_chunk_size_does_not_change_results(chunk):
    q, k, v, d, s0 = make(2, 2, 37)
    o, s = gk.lightning_attention(q, k, v, d, initial_state=s0, chunk_size=chunk)
    o_ref, s_ref = lightning_naive(q, k, v, d, s0)
    assert rel(o, o_ref) <= 1e-12 and rel(s, s_ref) <= 1e-12


@pytest.mark.parametrize("length", [1, 7, 37, 130])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("decay", ["none", "head", "steps"])
def test_gradients_match_naive_autograd(length, batch, decay):
    q, k, v, d, s0 = make(batch, 2, length, decay=decay)
    leaves = [q, k, v, s0] + ([d] if d is not None else [])
    for t in leaves:
        t.requires_grad_(True)
    gen = torch.Generator().manual_seed(7)
    go = torch.randn(batch, 2, length, 5, generator=gen, dtype=F64)
    gs = torch.randn(batch, 2, 4, 5, generator=gen, dtype=F64)

    def loss(o, s):  # the final state is consumed downstream: its gradient must propagate
        return (o * go).sum() + (s * gs).sum()

    got = torch.autograd.grad(loss(*gk.lightning_attention(q, k, v, d, initial_state=s0, chunk_size=16)), leaves)
    ref = torch.autograd.grad(loss(*lightning_naive(q, k, v, d, s0)), leaves)
    for x, y in zip(got, ref):
        assert x.shape == y.shape
        assert rel(x, y) <= 1e-10


def test_gradient_only_through_final_state_and_no_initial_state():
    q, k, v, d, _ = make(3, 2, 37)
    leaves = [q, k, v, d]
    for t in leaves:
        t.requires_grad_(True)
    got = torch.autograd.grad(gk.lightning_attention(q, k, v, d, chunk_size=8)[1].square().sum(), leaves)
    ref = torch.autograd.grad(lightning_naive(q, k, v, d, None)[1].square().sum(), leaves[1:])
    assert torch.count_nonzero(got[0]) == 0  # the final state does not depend on q
    for x, y in zip(got[1:], ref):
        assert rel(x, y) <= 1e-10


def test_tiny_and_zero_decays_are_exact():
    q, k, v, d, s0 = make(2, 2, 37)
    d = d * 1e-6
    d[:, :, ::5] = 0.0  # a log/division based scheme breaks here
    leaves = [q, k, v, d, s0]
    for t in leaves:
        t.requires_grad_(True)
    o, s = gk.lightning_attention(q, k, v, d, initial_state=s0, chunk_size=8)
    o_ref, s_ref = lightning_naive(q, k, v, d, s0)
    assert rel(o, o_ref) <= 1e-12 and rel(s, s_ref) <= 1e-12
    got = torch.autograd.grad(o.sum() + s.sum(), leaves)
    ref = torch.autograd.grad(o_ref.sum() + s_ref.sum(), leaves)
    for x, y in zip(got, ref):
        assert torch.isfinite(x).all() and rel(x, y) <= 1e-10


@pytest.mark.parametrize("decay", ["head", "steps"])
def test_lasp_chaining_gives_full_sequence_gradients(decay):
    """Two 'ranks': rank 1 starts from rank 0's final state; backward passes dS back."""
    q, k, v, d, s0 = make(3, 2, 37, decay=decay)
    leaves = [q, k, v, d, s0]
    for t in leaves:
        t.requires_grad_(True)
    cut = 20
    d0, d1 = (d, d) if decay == "head" else (d[:, :, :cut], d[:, :, cut:])
    o0, s_mid = gk.lightning_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], d0, initial_state=s0, chunk_size=8)
    o1, s_end = gk.lightning_attention(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], d1, initial_state=s_mid, chunk_size=8)
    o_ref, s_ref = lightning_naive(q, k, v, d, s0)
    assert rel(torch.cat([o0, o1], 2), o_ref) <= 1e-12 and rel(s_end, s_ref) <= 1e-12
    got = torch.autograd.grad(torch.cat([o0, o1], 2).sin().sum() + s_end.sum(), leaves)
    ref = torch.autograd.grad(o_ref.sin().sum() + s_ref.sum(), leaves)
    for x, y in zip(got, ref):
        assert rel(x, y) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs(dtype):
    q, k, v, d, s0 = make(2, 2, 130, dk=8, dv=8)
    lo = [t.to(dtype) for t in (q, k, v, d)]
    o, s = gk.lightning_attention(*lo, initial_state=s0.float(), chunk_size=32)
    assert o.dtype == dtype and s.dtype == torch.float32
    o_ref, s_ref = lightning_naive(*(t.double() for t in lo), s0.float().double())
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert rel(o.double(), o_ref) <= tol and rel(s.double(), s_ref) <= 1e-5


def test_trace_records_one_custom_op():
    q, k, v, d, s0 = make(1, 2, 7)

    def f(q, k, v, d):
        o, s = gk.lightning_attention(q, k, v, d, chunk_size=4)
        return o.sum() + s.sum()

    gm = make_fx(f, pre_dispatch=True)(q, k, v, d)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.gradshard.lightning_attention.default) == 1
    assert not any("cumprod" in str(t) or "bmm" in str(t) or "matmul" in str(t) for t in targets)
    node = next(n for n in gm.graph.nodes if n.target == torch.ops.gradshard.lightning_attention.default)
    assert node.args[4] is None  # optional initial_state is None in the schema
    assert torch.allclose(gm(q, k, v, d), f(q, k, v, d))


def test_clear_errors():
    q, k, v, d, s0 = make(2, 2, 7)
    with pytest.raises(ValueError, match="decay must be"):
        gk.lightning_attention(q, k, v, d[:, :, :3])
    with pytest.raises(ValueError, match="initial_state must be"):
        gk.lightning_attention(q, k, v, initial_state=s0[:, :, :2])
    with pytest.raises(ValueError, match="q and k"):
        gk.lightning_attention(q, k[..., :2], v)
    with pytest.raises(ValueError, match="chunk_size"):
        gk.lightning_attention(q, k, v, chunk_size=0)
