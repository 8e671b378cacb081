"""``da`` of the diagonal adjoint: ``sum_to_size(lam_t * h_{t-1}, a.shape)`` for any broadcast of ``a``
(scalar per head, per channel, shared over time or batch), with and without an initial state; the
contraction path (a decay shared over state dims) equals the product summed down (float64)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradshard.plans.adjoint.scan import _sum_of_products


@settings(max_examples=60, deadline=None)
@given(dims=st.lists(st.integers(1, 4), min_size=3, max_size=5),
       keep=st.lists(st.booleans(), min_size=5, max_size=5),
       with_h0=st.booleans(), seed=st.integers(0, 2**16))
def test_sum_of_products_matches_the_product_summed_down(dims: list[int], keep: list[bool], with_h0: bool,
                                                         seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    shape_lam = tuple(dims)
    shape_a = tuple(n if k else 1 for n, k in zip(shape_lam, keep))
    lam = torch.randn(shape_lam, dtype=torch.float64, generator=g)
    h = torch.randn(shape_lam, dtype=torch.float64, generator=g)
    h0 = torch.randn((shape_lam[0], *shape_lam[2:]), dtype=torch.float64, generator=g) if with_h0 else None
    first = h0.unsqueeze(1) if h0 is not None else torch.zeros_like(h[:, :1])
    want = (lam * torch.cat([first, h[:, :-1]], 1)).sum_to_size(shape_a)
    got = _sum_of_products(lam, h, h0, shape_a)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
