"""plan="spaco": exact expectation by enumerating every selection outcome (k <= 6 chunks).

Bernoulli sampling (keep each chunk w.p. q = t/k, scale its cotangents by 1/q) must be
exactly unbiased: sum over all 2^k outcomes of P(S) * grad(S) equals the exact gradient in
float64. The paper's "fixed" t-of-k scheme and a compensation cap are biased; the tests
check the bias is there (and bench/bench_spaco_learning.py reports its size).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import gradshard as gs
from chunk_testing import grads, rel_err
from examples.factories import hybrid, llama_loss
from gradshard.plans.chunked.runtime import force_selection


def _loss_setup(seq_len: int = 11, chunk: int = 2):
    fn, (model, batch) = llama_loss(seq_len=seq_len, batch=2, dtype=torch.float64)
    exact = grads(fn(model, batch), list(model.parameters()))
    return fn, model, batch, exact


def _expectation(cm, model, batch, outcomes):
    ps = list(model.parameters())
    acc = [torch.zeros_like(p) for p in ps]
    for sel, prob in outcomes:
        with force_selection(sel):
            g = grads(cm(model, batch), ps)
        region = cm.graph.spaco_0
        assert region.last_selection.indices == tuple(sorted(sel))
        for a, x in zip(acc, g):
            if x is not None:
                a.add_(x, alpha=prob)
    return acc


def _bernoulli_outcomes(k: int, q: float):
    for r in range(k + 1):
        for sel in itertools.combinations(range(k), r):
            yield sel, q**r * (1 - q) ** (k - r)


def test_bernoulli_expectation_is_exact_loss_inside() -> None:
    fn, model, batch, exact = _loss_setup()
    cm = gs.compile(fn, plan="spaco", chunk_size=2, budget=3)  # k = 6, q = 1/2
    cm(model, batch)
    assert cm.graph.spaco_0.program.num_chunks == 6
    mean = _expectation(cm, model, batch, _bernoulli_outcomes(6, 0.5))
    assert rel_err(exact, mean) <= 1e-10


@pytest.mark.slow  # the loss-inside case runs by default; suite time budget
def test_bernoulli_expectation_is_exact_hybrid_loss_outside() -> None:
    model, (ids,) = hybrid(seq_len=9, batch=2, dtype=torch.float64)
    cot = torch.randn(2, 9, 256, dtype=torch.float64)
    ps = list(model.parameters())
    exact = grads(model(ids), ps, cot)
    cm = gs.compile(model, plan="spaco", chunk_size=2, budget=2)  # k = 5, q = 2/5
    q = 2 / 5
    acc = [torch.zeros_like(p) for p in ps]
    for sel, prob in _bernoulli_outcomes(5, q):
        with force_selection(sel):
            g = grads(cm(ids), ps, cot)
        for a, x in zip(acc, g):
            if x is not None:
                a.add_(x, alpha=prob)
    assert rel_err(exact, acc) <= 1e-10


def test_fixed_sampling_is_biased_and_its_expectation_is_what_we_compute() -> None:
    fn, model, batch, exact = _loss_setup()
    cm = gs.compile(fn, plan="spaco", chunk_size=2, budget=3, sampling="fixed")  # k/t = 2
    subsets = list(itertools.combinations(range(6), 3))
    mean = _expectation(cm, model, batch, [(s, 1 / len(subsets)) for s in subsets])
    bias = rel_err(exact, mean)
    assert bias > 1e-3  # paths through several chunks survive with prob. C(k-p,t-p)/C(k,t) != (t/k)^p
    # the single-chunk terms are unbiased: with one chunk the estimate is exact in expectation
    cm1 = gs.compile(fn, plan="spaco", chunk_size=11, budget=1, sampling="fixed")
    assert rel_err(exact, grads(cm1(model, batch), list(model.parameters()))) <= 1e-10


@pytest.mark.slow  # keeps the default suite under 15 min on 2 cores; `make test-all` runs it
def test_capped_compensation_is_biased() -> None:
    fn, model, batch, exact = _loss_setup()
    cm = gs.compile(fn, plan="spaco", chunk_size=2, budget=2, max_compensation=2.0)  # 1/q = 3 capped to 2
    mean = _expectation(cm, model, batch, _bernoulli_outcomes(6, 1 / 3))
    bias = rel_err(exact, mean)
    assert bias > 0.05  # every term scaled by at most 2 * (1/3) < 1: the estimate shrinks


def test_unselected_chunks_skip_backward_and_generator_reproduces() -> None:
    fn, model, batch, _ = _loss_setup(seq_len=16)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    runs = []
    for gen in (g1, g2):
        cm = gs.compile(fn, plan="spaco", chunk_size=2, budget=3, generator=gen)  # k = 8
        out = []
        for _ in range(3):
            model.zero_grad()
            cm(model, batch).backward()
            region = cm.graph.spaco_0
            out.append((region.last_selection.indices, [p.grad.clone() for p in model.parameters()]))
        runs.append((out, dict(region.stats)))
    (a, stats), (b, _) = runs
    for (sa, ga), (sb, gb) in zip(a, b):
        assert sa == sb and rel_err(ga, gb) == 0.0
    kept = sum(len(s) for s, _ in a)
    assert stats["backward_chunks"] == kept and stats["skipped_chunks"] == 3 * 8 - kept


def test_budget_at_least_k_equals_seco() -> None:
    fn, model, batch, exact = _loss_setup()
    cm = gs.compile(fn, plan="spaco", chunk_size=3, budget=10, sampling="fixed")
    assert rel_err(exact, grads(cm(model, batch), list(model.parameters()))) <= 1e-10


@pytest.mark.slow  # keeps the default suite under 15 min on 2 cores; `make test-all` runs it
def test_bernoulli_draw_frequency() -> None:
    fn, model, batch, _ = _loss_setup(seq_len=16)
    gen = torch.Generator().manual_seed(0)
    cm = gs.compile(fn, plan="spaco", chunk_size=2, budget=2, generator=gen)  # k = 8, q = 1/4
    counts = 0
    n = 40
    for _ in range(n):
        cm(model, batch).backward()
        region = cm.graph.spaco_0
        counts += len(region.last_selection.indices)
        assert set(region.last_selection.factors) <= {0.0, 4.0}
    mean = counts / n
    assert abs(mean - 2.0) < 4 * math.sqrt(8 * 0.25 * 0.75 / n)
