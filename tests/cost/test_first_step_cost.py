"""The cost model prices the first step (issue 17): the compile a fresh module's first call runs.

Predictions (``first_step_*``: the steady step plus the compile, fitted per length regime) are
checked against ``gs.measure`` of a fresh compiled module's first step. Allocated bytes and
FLOPs are deterministic counts; the peak moves by a few KiB with garbage collection.

A first step is measured in a fresh process: inside the whole suite, caches other tests warmed
(dispatch, fake-tensor and compile caches) shrink what a first call allocates, so the three
measured checks run in a child pytest (``test_first_step_predictions_in_a_fresh_process``).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import sympy

import gradshard as gs
from gradshard.cost import FIRST_STEP_QUANTITIES
from gradshard.cost.first_step import compile_regimes
from gradshard.cost.rules import get_rule
from gradshard.cost.validate import measure_first_and_steady
from gradshard.examples import factories as F
from gradshard.plans import get_plan

TOL = 0.10
FRESH = os.environ.get("GS_FIRST_STEP_FRESH_PROCESS") == "1"


@pytest.mark.slow  # the default suite stays under 15 min on 2 cores; `make test-all` runs it (66 s: a fresh process of first-step probes)
def test_first_step_predictions_in_a_fresh_process() -> None:
    if FRESH:
        return
    env = dict(os.environ, GS_FIRST_STEP_FRESH_PROCESS="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "within_ten_percent"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "3 passed" in run.stdout, run.stdout[-6000:] + run.stderr[-3000:]


def _check(report, factory, plan: str, options: dict, seq_len: int, batch: int = 2) -> None:
    first, steady = measure_first_and_steady(factory, plan, options, seq_len, batch)
    v = report.evaluate(seq_len=seq_len, batch=batch)
    for q, measured in (("allocated_bytes", first.allocated_bytes), ("flops", first.flops),
                        ("peak_bytes", first.peak_bytes)):
        predicted = v[f"first_step_{q}"]
        assert abs(predicted - measured) <= TOL * measured, (plan, seq_len, q, predicted, measured)
    # what the first call adds is the compile: the steady terms are the report's own
    assert v["first_step_allocated_bytes"] == v["allocated_bytes"] + v["compile_allocated_bytes"]
    # the compile's traces run on fake tensors: it adds FLOPs, and real bytes only for what the
    # passes run on real tensors
    assert first.flops > steady.flops and first.allocated_bytes >= steady.allocated_bytes


@pytest.fixture(scope="module")
def ssm_seco():
    target, inputs = F.ssm(seq_len=32)
    return gs.cost(target, "seco", example_inputs=inputs, chunk_size=8)


def test_chunked_compile_regimes_bend_at_six_chunks_and_at_the_probe() -> None:
    probe = get_plan("seco").probe_length
    opts = get_plan("seco").make_options(chunk_size=8)
    assert compile_regimes("seco", opts, get_rule("seco")) == [(0, 48), (48, 2 * probe), (2 * probe, math.inf)]
    opts = get_plan("seco").make_options(chunk_size=512)  # the probe comes first: one chunk at 67 steps
    assert compile_regimes("seco", opts, get_rule("seco")) == [(0, 2 * probe), (2 * probe, 3072), (3072, math.inf)]
    # plain autograd compiles a long first call at the probe too
    assert compile_regimes("none", get_plan("none").make_options(), get_rule("none")) == [(0, 2 * probe), (2 * probe, math.inf)]


@pytest.mark.skipif(not FRESH, reason="measured in a fresh process (test_first_step_predictions_in_a_fresh_process)")
def test_ssm_seco_first_step_within_ten_percent(ssm_seco) -> None:
    assert set(FIRST_STEP_QUANTITIES) <= set(ssm_seco.expressions)
    assert isinstance(ssm_seco.expressions["compile_allocated_bytes"], sympy.Piecewise)
    _check(ssm_seco, F.ssm, "seco", {"chunk_size": 8}, 56)


@pytest.mark.skipif(not FRESH, reason="measured in a fresh process (test_first_step_predictions_in_a_fresh_process)")
def test_ssm_seco_first_step_served_from_the_probe_within_ten_percent(ssm_seco) -> None:
    """T=151 > 2 x 67: the first call compiles at the probe and serves 151 (the last regime)."""
    _check(ssm_seco, F.ssm, "seco", {"chunk_size": 8}, 151)
    added = ssm_seco.first_step(seq_len=151, batch=2)
    assert added["allocated_bytes"]["added"] == ssm_seco.evaluate(seq_len=151, batch=2)["compile_allocated_bytes"]


@pytest.mark.skipif(not FRESH, reason="measured in a fresh process (test_first_step_predictions_in_a_fresh_process)")
def test_attention_model_first_step_within_ten_percent() -> None:
    target, inputs = F.llama(seq_len=32)
    report = gs.cost(target, "none", example_inputs=inputs)
    assert all(f.exact for f in report.compile_fits.values())  # one regime, a polynomial
    _check(report, F.llama, "none", {}, 40)
    assert "first_step_peak_bytes" in report.describe()


def test_a_report_can_leave_the_first_step_out() -> None:
    target, inputs = F.ssm(seq_len=32)
    report = gs.cost(target, "none", example_inputs=inputs, first_step=False)
    assert not any(q in report.expressions for q in FIRST_STEP_QUANTITIES)
    with pytest.raises(KeyError, match="first-step"):
        report.first_step(seq_len=64)
    assert report.compile_fits == {} and all(f.exact for f in report.fits.values())
