"""Acceptance: predicted peak memory within 10% and FLOPs within 5% of gs.measure, per plan and example.

The sweep covers every registered plan that has a validation case
(``gradshard.cost.validate.VALIDATION_CASES``) and every example factory; plans that do not
apply to a model must be refused by the compiler with a reason. The full matrix is ``slow``; a representative
subset runs by default. ``bench/bench_cost_validation.py`` prints the same sweep as a table.
"""

import pytest
import sympy

from examples import factories as F
from gradshard.cost import cost
from gradshard.cost.validate import VALIDATION_CASES, plan_applies, validate_plan

PEAK_TOL, FLOPS_TOL = 0.10, 0.05
# (example, plan) pairs run by default, at two lengths (one beyond every probe); the rest is slow.
FAST = {("ssm", "seco"): (56, 128)}


@pytest.fixture(scope="module")
def ssm_seco_report():
    """The report validate_plan builds for ssm under seco (built once: two tests price from it)."""
    target, inputs = F.ssm(seq_len=32)
    return cost(target, "seco", example_inputs=inputs, **VALIDATION_CASES["seco"].options)


def _cases():
    for plan in VALIDATION_CASES:
        for name in F.FACTORIES:
            for batch in (2, 1):  # batch 1 by default in test_batch_one_is_priced_from_batch_one_probes
                marks = [] if (name, plan) in FAST and batch == 2 else [pytest.mark.slow]
                yield pytest.param(name, plan, batch, id=f"{plan}-{name}-batch{batch}", marks=marks)


@pytest.mark.parametrize("name, plan, batch", list(_cases()))
def test_prediction_matches_measurement(name, plan, batch, request):
    case = VALIDATION_CASES[plan]
    why = plan_applies(F.FACTORIES[name], plan, case.options)
    if why is not None:
        # a plan that does not apply must refuse with one of gradshard's errors, naming why
        assert why.split(":")[0].endswith(("Error", "Refused")) and len(why) > 40, why
        return
    shared = request.getfixturevalue("ssm_seco_report") if (name, plan) == ("ssm", "seco") else None
    report, rows, _ = validate_plan(name, F.FACTORIES[name], plan, seq_lens=FAST.get((name, plan)), batch=batch,
                                    report=shared)
    bad = [r for r in rows if r.peak_error > PEAK_TOL or r.flops_error > FLOPS_TOL]
    detail = "\n".join(f"T={r.seq_len}: peak {r.predicted_peak} vs {r.measured_peak} ({r.peak_error:.2%}), "
                       f"flops {r.predicted_flops} vs {r.measured_flops} ({r.flops_error:.2%})" for r in rows)
    assert not bad, f"{plan} on {name}:\n{detail}\n{report.describe()}"
    assert any(not r.probed for r in rows), "every validated length was a probe length: nothing was predicted"


def test_batch_one_is_priced_from_batch_one_probes(ssm_seco_report):
    """At batch 1 a reshape of a broadcast tensor is a view, not a copy: the example SSM's seco
    step peaks at another op there, which the batch-2/3 fit put 6.7% low at T=40. The report
    checks batch 1 with a probe and, where it differs, fits batch 1 from its own probes."""
    report, rows, _ = validate_plan("ssm", F.FACTORIES["ssm"], "seco", seq_lens=(40, 136), batch=1,
                                    report=ssm_seco_report)
    assert [(r.predicted_peak, r.predicted_flops) for r in rows] == [(r.measured_peak, r.measured_flops) for r in rows]
    assert report.expressions["peak_bytes"].has(sympy.Piecewise)
    assert any("batch 1 runs another op sequence" in n for n in report.notes), report.notes
    _, rows2, _ = validate_plan("ssm", F.FACTORIES["ssm"], "seco", seq_lens=(40,), batch=2, report=report)
    assert rows2[0].predicted_peak == rows2[0].measured_peak  # the batched fit is unchanged
