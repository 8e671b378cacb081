"""DonatedGrad: an input's gradient written over the output gradient it was computed from.

Property: for any length, shard size and halo, running the adjoint backward's order (shards
right to left; each shard reads its output-gradient rows, then hands over its window's input
gradient) gives every shard the output-gradient rows it would have read from an untouched buffer,
and leaves exactly the input gradient plain accumulation into zeros gives.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradshard.plans.adjoint.donate import DonatedGrad, donatable
from gradshard.plans.adjoint.respecialize import shard_bounds


@settings(max_examples=150, deadline=None)
@given(T=st.integers(0, 40), shard=st.integers(1, 9), lh=st.integers(0, 12), rh=st.integers(0, 5),
       skip=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_donated_buffer_matches_plain_accumulation(T, shard, lh, rh, skip, seed):
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(2, T, 3, generator=g, dtype=torch.float64)
    original = dy.clone()
    plain = torch.zeros_like(dy)
    donated = DonatedGrad(dy, 1)
    for k, (s, e) in reversed(list(enumerate(shard_bounds(T, shard)))):
        assert torch.equal(dy[:, s:e], original[:, s:e]), "rows changed before their shard read them"
        ws, we = max(0, s - lh), min(T, e + rh)
        # every `skip`-th shard (when skip > 0) gives no gradient, as when none reaches the input
        gw = None if skip and k % (skip + 1) == 0 else torch.randn(2, we - ws, 3, generator=g, dtype=torch.float64)
        if gw is not None:
            plain[:, ws:we] += gw
        donated.close(s, e, gw, ws, we)
    assert donated.result() is dy
    assert torch.allclose(dy, plain, rtol=0, atol=1e-12)


def test_what_may_be_donated():
    x = torch.zeros(2, 5, 3)
    with torch.no_grad():  # as in a backward without create_graph
        assert donatable(torch.zeros(2, 5, 3), x.shape, x.dtype, x.device)
        assert not donatable(None, x.shape, x.dtype, x.device)
        assert not donatable(torch.zeros(2, 5, 4), x.shape, x.dtype, x.device)
        assert not donatable(torch.zeros(2, 5, 3, dtype=torch.float64), x.shape, x.dtype, x.device)
        assert not donatable(torch.zeros(2, 10, 3)[:, :5], x.shape, x.dtype, x.device)  # a view
        assert not donatable(torch.zeros(1, 5, 3).expand(2, 5, 3), x.shape, x.dtype, x.device)  # a broadcast
        assert not donatable(torch.empty_strided((2, 5, 3), (1, 2, 10)), x.shape, x.dtype, x.device)  # strided
    with torch.enable_grad():  # create_graph=True: the gradient may be part of a graph
        assert not donatable(torch.zeros(2, 5, 3), x.shape, x.dtype, x.device)
