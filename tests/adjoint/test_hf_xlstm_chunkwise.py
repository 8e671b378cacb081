"""xLSTM's chunkwise mLSTM (issue 16): the zoo's ``chunk_size=16`` at T above it runs a loop over
16-step blocks with one stabiliser per block (``mlstm_chunkwise_native_autograd``), then the
step recurrence over the tail. ``rewrite_chunkwise_mlstm`` proves the region equals the step
recurrence (float64, random inputs) and writes it out step by step; every plan then rolls that
loop like the step form. T = 48: three blocks, no tail, all float64 in eager (1e-10). T = 37:
two blocks and a 5-step tail that eager carries in float32 (``inference_state_dtype``): 1e-5
against eager, 1e-10 with that island computed in float64 (:class:`~tests.hf.zoo.Float64Everywhere`).
"""

from __future__ import annotations

import pytest

from gradshard.errors import GradshardError

from tests.hf import test_hf_plans
from tests.hf.test_hf_plans import _compare
from tests.hf.zoo import build

#: (plan, T, tolerance against eager); the slow ones run with ``-m slow`` (about 10 s each).
# the default suite: each plan once, one at a chunk multiple and one ragged (under 15 min on 2 cores)
CELLS = [("adjoint", 48, 1e-10), ("seco", 37, 1e-5)]
SLOW_CELLS = [("seco", 48, 1e-10), ("adjoint", 37, 1e-5), ("truncated_adjoint", 48, 1e-10), ("spaco", 48, 1e-10), ("truncated_adjoint", 37, 1e-5),
              ("spaco", 37, 1e-5)]


def _cell(plan: str, T: int, monkeypatch: pytest.MonkeyPatch, float64: bool = False) -> tuple[float, object]:
    monkeypatch.setattr(test_hf_plans, "T", T)
    model, config = build("xlstm", fp64_loss=False)  # the zoo's chunk_size: 16
    return _compare(model, config, plan, float64=float64)


def _notes(cm: object, name: str) -> list[str]:
    return [n for r in cm.passes if r.name == name for n in r.notes]


@pytest.mark.parametrize("plan, T, tol", [*CELLS, *[pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CELLS]],
                         ids=[f"{p}-T{t}" for p, t, _ in (*CELLS, *SLOW_CELLS)])
def test_chunkwise_mlstm_matches_eager(plan: str, T: int, tol: float, monkeypatch: pytest.MonkeyPatch) -> None:
    err, cm = _cell(plan, T, monkeypatch)
    assert err <= tol, err
    notes = _notes(cm, "rewrite_chunkwise_mlstm")
    assert len(notes) == 2 and all(f"chunkwise mLSTM ({T} steps" in n for n in notes), notes  # one per layer


@pytest.mark.slow
def test_chunkwise_mlstm_with_float64_tail_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _cell("adjoint", 37, monkeypatch, float64=True)[0] <= 1e-10


def test_a_region_that_differs_from_the_recurrence_is_not_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proof decides: a kernel whose carried block states are off by 1e-3 (relative) keeps
    its block loop, which the adjoint plans refuse naming the running maximum (its ``max`` op: the
    stabiliser is not linear in the state) and the source line."""
    from transformers.models.xlstm import modeling_xlstm as mx

    fw_c = mx.mlstm_chunkwise_recurrent_fw_C

    def off(*args, **kwargs):
        C, n, m = fw_c(*args, **kwargs)
        return C * (1 + 1e-3), n, m

    monkeypatch.setattr(mx, "mlstm_chunkwise_recurrent_fw_C", off)
    with pytest.raises(GradshardError, match=r"running maximum|\(call_function max\.other\)") as info:
        _cell("adjoint", 48, monkeypatch)
    assert "modeling_xlstm.py" in str(info.value) and "plan='none'" in str(info.value)
