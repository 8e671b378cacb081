"""RWKV and xLSTM (issue 16): their per-step loops carry several values, one a running maximum
(log-sum-exp stabilisers). The chunked plans roll such a loop into a carried loop and match
eager; the adjoint plans split it into the maximum (run step by step) and one scan of the
max-shifted states (``roll_driven_loops``) and match eager too (float64 exactness, 150 steps
and large inputs: ``tests/adjoint/test_hf_rwkv_adjoint.py``).

xLSTM runs its step recurrence (``mlstm_recurrent_sequence_native``) for sequences shorter than
its ``chunk_size``; the zoo's ``chunk_size=16`` runs whole 16-token blocks through a Python loop
over blocks first, which ``rewrite_chunkwise_mlstm`` proves equal to the step recurrence and
writes out step by step (``test_xlstm_block_loop_*``; every plan and T = 48:
``tests/adjoint/test_hf_xlstm_chunkwise.py``).
Both models compute part of their float64 forward in float32 (RWKV's ``key.float()``, xLSTM's
float32 states): 1e-5 against eager, and exact to 1e-10 with those islands computed in float64
(:class:`~tests.hf.zoo.Float64Everywhere`, slow).
"""

from __future__ import annotations

import pytest

from . import test_hf_plans
from .test_hf_plans import _compare, _run_cell, _tolerance
from .zoo import build

#: xLSTM with its step recurrence over the whole test length (T = 37 < chunk_size).
STEP_XLSTM = {"chunk_size": 64}
OVERRIDES = {"rwkv": {}, "xlstm": STEP_XLSTM}
CELLS = [("rwkv", "seco"), ("xlstm", "seco")]
SLOW_CELLS = [("rwkv", "spaco"), ("xlstm", "spaco")]


def _cell(family: str, plan: str, float64: bool = False) -> tuple[float, object]:
    model, config = build(family, fp64_loss=False, **OVERRIDES[family])
    return _compare(model, config, plan, float64=float64)


@pytest.fixture
def short(monkeypatch: pytest.MonkeyPatch) -> None:
    """T = 21 (three chunks of 8, the last one short) instead of the matrix's 37: the chunk
    planner's dry run of RWKV's token-shifted layers dominates the cell's time."""
    monkeypatch.setattr(test_hf_plans, "T", 21)


@pytest.mark.parametrize("family, plan", [*CELLS, *[pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CELLS]],
                         ids=["-".join(c) for c in (*CELLS, *SLOW_CELLS)])
def test_chunked_plan_matches_eager(family: str, plan: str, short: None) -> None:
    err, cm = _cell(family, plan)
    assert err <= _tolerance(family, "eager"), err
    notes = [n for r in cm.passes if r.name == "roll_loops_carrying" for n in r.notes]
    assert notes and all("carrying 3 value(s)" in n for n in notes), notes  # (num, den, max) / (C, n, m)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["rwkv", "xlstm"])
def test_chunked_plan_is_exact_with_float64_islands(family: str) -> None:
    assert _cell(family, "seco", float64=True)[0] <= 1e-10


@pytest.mark.parametrize("family, plan", [("rwkv", "adjoint"), pytest.param("xlstm", "adjoint", marks=pytest.mark.slow),
                                          pytest.param("rwkv", "truncated_adjoint", marks=pytest.mark.slow)])
def test_adjoint_plans_split_the_running_max_and_match_eager(family: str, plan: str, short: None) -> None:
    err, cm = _cell(family, plan)
    assert err <= _tolerance(family, "eager"), err
    notes = [n for r in cm.passes if r.name == "roll_driven_loops" for n in r.notes]
    assert len(notes) == 2 and all("packed into one scan" in n for n in notes), notes  # one per layer


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["seco", "adjoint"])
def test_xlstm_block_loop_becomes_the_step_recurrence_and_matches_eager(plan: str) -> None:
    """The zoo's xLSTM at T = 37 first runs two 16-token blocks through a loop over blocks: the
    region (blocks and the 5-step tail) is proven equal to the step recurrence and rolled."""
    model, config = build("xlstm", fp64_loss=False)
    err, cm = _compare(model, config, plan)
    assert err <= _tolerance("xlstm", "eager"), err
    notes = [n for r in cm.passes if r.name == "rewrite_chunkwise_mlstm" for n in r.notes]
    assert len(notes) == 2 and all("chunkwise mLSTM (37 steps" in n for n in notes), notes


@pytest.mark.slow
@pytest.mark.parametrize("family", ["xlstm", "rwkv"])
def test_plain_plan_is_exact(family: str) -> None:
    assert _run_cell(family, "eager", "none") <= _tolerance(family, "eager")
