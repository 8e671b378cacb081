"""``CostReport.max_seq_len`` agrees with a bisection over real measured runs on small budgets."""

import pytest

from examples import factories as F
from gradshard.cost import cost
from gradshard.cost.validate import bisect_max_seq_len, measure_step


@pytest.fixture(scope="module")
def llama_report():
    target, inputs = F.llama(seq_len=32)
    return cost(target, "none", example_inputs=inputs)


@pytest.mark.parametrize("budget_at", [pytest.param(37, marks=pytest.mark.slow), 101])
def test_max_seq_len_matches_bisection_plan_none(llama_report, budget_at):
    report = llama_report
    # a budget between the measured peaks of two consecutive lengths
    budget = (measure_step(F.llama, "none", {}, budget_at, 2).peak_bytes +
              measure_step(F.llama, "none", {}, budget_at + 1, 2).peak_bytes) // 2
    predicted = report.max_seq_len(budget, batch=2, quantity="peak_bytes")
    truth = bisect_max_seq_len(F.llama, "none", {}, budget, batch=2, lo=8, hi=256)
    assert predicted == truth == budget_at


@pytest.mark.slow  # default suite under 15 min on 2 cores; runs in `make test-all` (the plan-none bisection runs by default)
def test_max_seq_len_matches_bisection_chunked():
    target, inputs = F.ssm(seq_len=32)
    report = cost(target, "seco", example_inputs=inputs, chunk_size=8)
    budget = measure_step(F.ssm, "seco", {"chunk_size": 8}, 96, 2).peak_bytes + 100
    predicted = report.max_seq_len(budget, batch=2, quantity="peak_bytes", multiple_of=8)
    truth = bisect_max_seq_len(F.ssm, "seco", {"chunk_size": 8}, budget, batch=2, lo=32, hi=256, multiple_of=8)
    assert predicted == truth
