"""Property tests: capture + plan="none" preserves values and gradients on random stacks."""

from __future__ import annotations

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradshard as gs

from .helpers import assert_identical, run_both
from .models import CausalConv, CausalSelfAttention, CumsumMixer, SDPABlock

D = 8
BLOCKS = {
    "linear": lambda: nn.Linear(D, D),
    "gelu": nn.GELU,
    "layernorm": lambda: nn.LayerNorm(D),
    "conv": lambda: CausalConv(D, 3),
    "cumsum": lambda: CumsumMixer(D),
    "sdpa": lambda: SDPABlock(D),
    "attention": lambda: CausalSelfAttention(D, mask="add"),
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stack=st.lists(st.sampled_from(sorted(BLOCKS)), min_size=1, max_size=4),
    batch=st.integers(1, 3),
    seq=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_plan_none_preserves_values_and_gradients(stack, batch, seq, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(*(BLOCKS[b]() for b in stack)).double()
    x = torch.randn(batch, seq, D, dtype=torch.float64, requires_grad=True)
    o1, o2, g1, g2 = run_both(lambda t: gs.compile(t, plan="none"), model, (x,))
    assert_identical(o1, o2)
    assert_identical(g1, g2)
