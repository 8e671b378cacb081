"""Acceptance: predicted peak memory within 10% and FLOPs within 5% of gs.measure, per plan and example.

The sweep covers every registered plan that has a validation case
(``gradshard.cost.validate.VALIDATION_CASES``) and every example factory; plans that do not
apply to a model must be refused by the compiler with a reason. The full matrix is ``slow``; a representative
subset runs by default. ``bench/bench_cost_validation.py`` prints the same sweep as a table.
"""

import pytest

from examples import factories as F
from gradshard.cost.validate import VALIDATION_CASES, plan_applies, validate_plan

PEAK_TOL, FLOPS_TOL = 0.10, 0.05
# (example, plan) pairs run by default, at two lengths (one beyond every probe); the rest is slow.
FAST = {("ssm", "seco"): (56, 128)}


def _cases():
    for plan in VALIDATION_CASES:
        for name in F.FACTORIES:
            marks = [] if (name, plan) in FAST else [pytest.mark.slow]
            yield pytest.param(name, plan, id=f"{plan}-{name}", marks=marks)


@pytest.mark.parametrize("name, plan", list(_cases()))
def test_prediction_matches_measurement(name, plan):
    case = VALIDATION_CASES[plan]
    why = plan_applies(F.FACTORIES[name], plan, case.options)
    if why is not None:
        # a plan that does not apply must refuse with one of gradshard's errors, naming why
        assert why.split(":")[0].endswith(("Error", "Refused")) and len(why) > 40, why
        return
    report, rows, _ = validate_plan(name, F.FACTORIES[name], plan, seq_lens=FAST.get((name, plan)))
    bad = [r for r in rows if r.peak_error > PEAK_TOL or r.flops_error > FLOPS_TOL]
    detail = "\n".join(f"T={r.seq_len}: peak {r.predicted_peak} vs {r.measured_peak} ({r.peak_error:.2%}), "
                       f"flops {r.predicted_flops} vs {r.measured_flops} ({r.flops_error:.2%})" for r in rows)
    assert not bad, f"{plan} on {name}:\n{detail}\n{report.describe()}"
    assert any(not r.probed for r in rows), "every validated length was a probe length: nothing was predicted"
