"""plan="auto": the cost model picks the fastest candidate that fits the memory budget."""

from __future__ import annotations

import pytest
import torch

import gradshard as gs
from gradshard.autoplan import Candidate, choose_plan
from gradshard.errors import GradshardError
from gradshard.examples import factories as F

# A few candidates keep the test fast; the default grid prices more shard/chunk sizes.
SMALL = (Candidate("none"), Candidate("adjoint", {"shard_size": 8}), Candidate("seco", {"chunk_size": 8}),
         Candidate("truncated_adjoint", {"window": 8, "shard_size": 8}, exact=False))


def _model(seq_len: int = 37):
    model, (ids,) = F.ssm(seq_len=seq_len)
    return model.double(), ids


def test_auto_picks_a_plan_that_fits_and_trains_exactly() -> None:
    model, ids = _model()
    plain = gs.cost(model, "none", example_inputs=(ids,)).evaluate()["peak_bytes"]
    budget = 0.9 * plain  # below plain autograd's predicted peak: a memory plan must be chosen
    cm = gs.compile(model, plan="auto", memory_budget=budget, candidates=SMALL[:2])
    cm(ids).sum().backward()
    assert cm.choice.candidate == SMALL[1] and cm.plan == "adjoint" and cm.options == {"shard_size": 8}
    priced = {p.candidate.label(): p for p in cm.choice.priced}
    assert priced["adjoint(shard_size=8)"].peak_bytes <= budget < priced["none"].peak_bytes
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(ids).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-12)
    text = cm.explain()
    assert "plan='auto': chose adjoint(shard_size=8)" in text and "over budget" in text
    assert "gradshard plan 'adjoint'" in text


def test_approximate_plans_only_when_allowed() -> None:
    model, ids = _model()
    with pytest.raises(GradshardError, match="allow_approximate=True"):
        choose_plan(model, (ids,), memory_budget=1e12, candidates=SMALL[3:])
    choice = choose_plan(model, (ids,), memory_budget=1e12, candidates=SMALL[3:], allow_approximate=True)
    assert choice.candidate.plan == "truncated_adjoint"


def test_nothing_fits_says_the_smallest_peak_and_the_longest_sequence() -> None:
    model, ids = _model()
    with pytest.raises(GradshardError, match=r"(?s)no plan fits .*smallest predicted peak is .*fits up to T="):
        choose_plan(model, (ids,), memory_budget=1000, candidates=SMALL[:2])


def test_auto_needs_a_budget_and_takes_no_plan_options() -> None:
    model, _ = _model()
    with pytest.raises(GradshardError, match="needs memory_budget"):
        gs.compile(model, plan="auto")
    with pytest.raises(GradshardError, match="takes no \\['chunk_size'\\]"):
        gs.compile(model, plan="auto", memory_budget="8GB", chunk_size=4)
    with pytest.raises(GradshardError, match="unknown device"):
        gs.compile(model, plan="auto", memory_budget="8GB", device="tpu")
