"""transformers' RecurrentGemma (Griffin: RG-LRU recurrent blocks + local attention) under
every plan.

Its RG-LRU computes per-head gates with ``baddbmm`` over ``x.reshape(batch*seq, heads, w)``
(time merged with batch, then split again), runs ``h = a_t * h + x_t`` as a Python loop that
writes each step into ``zeros_like(x)`` in place, accumulating in float32, and builds its
reset mask from in-graph positions. All plans are exact: float32 agreement (1e-5) as the
model ships, and 1e-10 when its float32 sites (RMSNorm, the scan's accumulator) compute in
float64.
"""

from __future__ import annotations

import pytest

from .test_hf_plans import _run_cell, _tolerance

PLANS = ["none", "seco", "spaco", "adjoint", "truncated_adjoint"]
#: Run in the default suite (the one cell that takes every new rule: the merged rows, the
#: step-filled buffer, the in-graph reset mask sliced per shard, the float32 self-check).
DEFAULT = [("sdpa", "adjoint")]
SLOW = [(a, p) for a in ("sdpa", "eager") for p in PLANS if (a, p) not in DEFAULT]


@pytest.mark.parametrize("attn, plan", DEFAULT, ids=["-".join(c) for c in DEFAULT])
def test_recurrent_gemma_is_exact(attn: str, plan: str) -> None:
    assert _run_cell("recurrent_gemma", attn, plan) <= _tolerance("recurrent_gemma", attn)


@pytest.mark.slow
@pytest.mark.parametrize("attn, plan", SLOW, ids=["-".join(c) for c in SLOW])
def test_recurrent_gemma_is_exact_under_every_plan(attn: str, plan: str) -> None:
    assert _run_cell("recurrent_gemma", attn, plan) <= _tolerance("recurrent_gemma", attn)


@pytest.mark.slow
@pytest.mark.parametrize("plan", [p for p in PLANS if p != "none"])
def test_recurrent_gemma_in_float64_is_exact_to_1e_10(plan: str) -> None:
    """With its float32 sites (RMSNorm's upcast, the scan's float32 accumulator) computed in
    float64 (``zoo.Float64Everywhere``, capture included; nothing in transformers patched)."""
    assert _run_cell("recurrent_gemma", "sdpa", plan, float64=True) <= 1e-10
