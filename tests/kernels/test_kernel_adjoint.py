"""adjoint_shard: chained over shards it reproduces autograd of the full scan (float64)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import gradshard.kernels as gk

F64 = torch.float64


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).norm() / y.norm().clamp_min(1e-300)).item()


def make(batch, length, state=(3, 2), a_shape=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(a_shape or (batch, length, *state), generator=g, dtype=F64) * 2 - 1
    a[a.abs() < 0.1] = 0.0
    u = torch.randn((batch, length, *state), generator=g, dtype=F64)
    gr = torch.randn((batch, length, *state), generator=g, dtype=F64)
    h0 = torch.randn((batch, *state), generator=g, dtype=F64)
    return a, u, gr, h0


@pytest.mark.parametrize("length", [1, 7, 37, 130])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("per_head", [False, True])
def test_chained_shards_equal_full_autograd(length, batch, shards, per_head):
    a, u, g, h0 = make(batch, length, a_shape=(batch, length, 3, 1) if per_head else None)
    for t in (a, u, h0):
        t.requires_grad_(True)
    ref = torch.autograd.grad((gk.scan_naive(a, u, h0) * g).sum(), (a, u, h0))
    bounds = sorted({0, length, *[(length * i) // shards for i in range(1, shards)]})
    with torch.no_grad():
        h = gk.linear_scan(a, u, h0)
        starts = [h0 if s == 0 else h[:, s - 1] for s in bounds[:-1]]  # shard-boundary checkpoints
        carry, ga, gu = None, [], []
        for (s, e), hs in reversed(list(zip(zip(bounds[:-1], bounds[1:]), starts))):
            da, du, carry = gk.adjoint_shard(a[:, s:e], u[:, s:e], g[:, s:e], hs, carry)
            ga.insert(0, da)
            gu.insert(0, du)
    assert rel(torch.cat(ga, 1), ref[0]) <= 1e-10
    assert rel(torch.cat(gu, 1), ref[1]) <= 1e-10
    assert rel(carry, ref[2]) <= 1e-10


def test_without_h0_and_carry():
    a, u, g, _ = make(2, 9)
    a.requires_grad_(True)
    u.requires_grad_(True)
    ref = torch.autograd.grad((gk.scan_naive(a, u) * g).sum(), (a, u))
    da, du, dh0 = gk.adjoint_shard(a, u, g)
    assert rel(da, ref[0]) <= 1e-10 and rel(du, ref[1]) <= 1e-10
    assert dh0.shape == (2, 3, 2) and rel(dh0, a[:, 0].detach() * du[:, 0]) <= 1e-15


def test_trace_records_one_custom_op():
    a, u, g, h0 = make(2, 7)
    gm = make_fx(lambda a, u, g, h0: gk.adjoint_shard(a, u, g, h0)[0], pre_dispatch=True)(a, u, g, h0)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.gradshard.adjoint_shard.default in targets
    assert len([t for t in targets if "gradshard" in str(t)]) == 1


def test_clear_errors():
    a, u, g, h0 = make(2, 7)
    with pytest.raises(ValueError, match="g must be shaped like u"):
        gk.adjoint_shard(a, u, g[:, :3], h0)
    with pytest.raises(ValueError, match="lam_carry must be"):
        gk.adjoint_shard(a, u, g, h0, h0[:1])
