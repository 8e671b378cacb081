"""plan="auto": the cost model picks the fastest candidate that fits the memory budget."""

from __future__ import annotations

import pytest
import torch

import gradshard as gs
from gradshard.autoplan import Candidate, Pricing, pick, price_candidates
from gradshard.errors import GradshardError
from gradshard.examples import factories as F

NONE, ADJOINT = Candidate("none"), Candidate("adjoint", {"shard_size": 8})
TRUNCATED = Candidate("truncated_adjoint", {"window": 8, "shard_size": 8}, exact=False)


def _model(seq_len: int = 37):
    model, (ids,) = F.ssm(seq_len=seq_len)
    return model.double(), ids


@pytest.fixture(scope="module")
def pricing() -> Pricing:
    """Plain autograd and the adjoint plan priced once (each costs a few compiles)."""
    model, ids = _model()
    return price_candidates(model, (ids,), candidates=(NONE, ADJOINT, TRUNCATED))


def test_pick_the_fastest_that_fits(pricing: Pricing) -> None:
    by = {p.candidate: p for p in pricing.priced}
    assert set(by) == {NONE, ADJOINT}  # the approximate candidate is not priced unless allowed
    assert by[ADJOINT].peak_bytes < by[NONE].peak_bytes
    assert pick(pricing, 10 * by[NONE].peak_bytes).candidate in (NONE, ADJOINT)
    between = (by[ADJOINT].peak_bytes + by[NONE].peak_bytes) / 2
    choice = pick(pricing, between)
    assert choice.candidate == ADJOINT
    text = choice.describe()
    assert "-> adjoint(shard_size=8)" in text and "over budget" in text


def test_nothing_fits_says_the_smallest_peak_and_the_longest_sequence(pricing: Pricing) -> None:
    with pytest.raises(GradshardError, match=r"(?s)no plan fits .*smallest predicted peak is .*adjoint"
                                             r".*fits up to T=.*allow_approximate=True"):
        pick(pricing, 1000)


def test_approximate_plans_only_when_allowed() -> None:
    model, ids = _model()
    with pytest.raises(GradshardError, match="allow_approximate=True"):
        price_candidates(model, (ids,), candidates=(TRUNCATED,))


@pytest.mark.slow  # the default suite stays under 15 min on 2 cores; `make test-all` runs it (39 s)
def test_compile_auto_trains_exactly_with_the_chosen_plan() -> None:
    model, ids = _model()
    cm = gs.compile(model, plan="auto", memory_budget="1GB", candidates=(ADJOINT,))
    cm(ids).sum().backward()
    assert cm.choice.candidate == ADJOINT and cm.plan == "adjoint" and cm.options == {"shard_size": 8}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(ids).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-12)
    text = cm.explain()
    assert "plan='auto': chose adjoint(shard_size=8)" in text and "gradshard plan 'adjoint'" in text


def test_auto_needs_a_budget_and_takes_no_plan_options() -> None:
    model, _ = _model()
    with pytest.raises(GradshardError, match="needs memory_budget"):
        gs.compile(model, plan="auto")
    with pytest.raises(GradshardError, match="takes no \\['chunk_size'\\]"):
        gs.compile(model, plan="auto", memory_budget="8GB", chunk_size=4)
    with pytest.raises(GradshardError, match="unknown device"):
        gs.compile(model, plan="auto", memory_budget="8GB", device="tpu")
