"""RWKV and xLSTM (issue 16): the plans that run are exact; the chunked/adjoint plans refuse the
max-stabilised recurrence naming its running maximum (xLSTM: with advice naming only plans that work).

Slow (each cell compiles a tiny HF model, 10-60 s on CPU); the matrix cells are also in
``test_hf_plans.py::test_every_cell_is_exact_or_refused``.
"""

from __future__ import annotations

import pytest

from gradshard.errors import GradshardError

from .test_hf_plans import _run_cell, _tolerance

REFUSED = [("xlstm", "seco"), ("xlstm", "adjoint")]


@pytest.mark.slow
@pytest.mark.parametrize("family, plan", REFUSED, ids=["-".join(c) for c in REFUSED])
def test_stabilised_recurrence_is_refused_naming_the_running_max(family: str, plan: str) -> None:
    with pytest.raises(GradshardError, match="running maximum") as info:
        _run_cell(family, "eager", plan)
    text = str(info.value)
    assert "modeling_" in text and "runs along time" not in text
    assert "plan='seco'" not in text


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["seco", "adjoint"])
def test_rwkv_wkv_loop_is_refused_naming_its_running_max(plan: str) -> None:
    """Not yet recognised: the WKV loop's steps are cut mid-update (the readout reads the previous
    state), so the refusal comes from the step comparison, still naming the ``maximum`` node."""
    with pytest.raises(GradshardError, match=r"node `maximum_\d+`") as info:
        _run_cell("rwkv", "eager", plan)
    assert "modeling_rwkv.py" in str(info.value)
    assert "plan='seco'" not in str(info.value)  # seco rolls loops too: the advice names only plans that work


@pytest.mark.slow
@pytest.mark.parametrize("family", ["xlstm", "rwkv"])
def test_plain_plan_is_exact(family: str) -> None:
    assert _run_cell(family, "eager", "none") <= _tolerance(family, "eager")
