"""The adjoint rewrite checks itself on the example inputs, at a length that does not grow
with the captured one: the graph re-specialised to the example's first CHECK_LEN steps (or the
whole example when the graph does not re-specialise, up to VERIFY_MAX_LEN)."""

from __future__ import annotations

import pytest
import torch

import gradshard as gs
from gradshard.errors import GradshardError
from gradshard.plans.adjoint import rewrite
from gradshard.plans.adjoint.runtime import AdjointRegion
from tests.adjoint.helpers import assert_same_grads
from tests.adjoint.models import DiagonalSSM

T = rewrite.CHECK_LEN + 45  # beyond the check length, odd


@pytest.fixture(autouse=True)
def full_length_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests exercise the self-check of a compile at the call's full length; a long first
    call otherwise compiles at the plan's probe length and is served from there
    (tests/adjoint/test_length_generic.py)."""
    monkeypatch.setattr(gs.CompiledModule, "_compile_probe", lambda self, args, kwargs: False)


def _notes(cm: gs.CompiledModule) -> list[str]:
    return [n for r in cm.passes for n in r.notes if "self-check" in n]


def test_a_long_example_is_checked_on_its_first_steps_and_stays_exact() -> None:
    model = DiagonalSSM(scan="cumprod", conv=True, h0=True).double()
    x = torch.randn(3, T, 6, dtype=torch.float64)
    cm = assert_same_grads(model, (x,), shard_size=64)
    assert _notes(cm) == [f"self-check on the example's first {rewrite.CHECK_LEN} of {T} steps"]


def test_the_short_check_still_catches_a_wrong_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    model = DiagonalSSM(scan="cumprod").double()
    x = torch.randn(2, T, 6, dtype=torch.float64)
    real = AdjointRegion.forward

    def off_by_a_little(self, *args):
        return tuple(o + 1e-3 if isinstance(o, torch.Tensor) else o for o in real(self, *args))

    monkeypatch.setattr(AdjointRegion, "forward", off_by_a_little)
    with pytest.raises(GradshardError, match="internal check failed: recomputing region adjoint_0"):
        gs.compile(model, plan="adjoint", shard_size=64)(x)


def test_a_graph_that_does_not_respecialise_is_checked_at_full_length(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise rewrite.RespecializeError("node `div` has a baked length")

    monkeypatch.setattr(rewrite, "respecialize", refuse)
    x = torch.randn(2, T, 6, dtype=torch.float64)
    cm = assert_same_grads(DiagonalSSM(scan="cumprod").double(), (x,), shard_size=64)
    (note,) = _notes(cm)
    assert note.startswith(f"self-check at the full {T} steps (no re-specialisation to {rewrite.CHECK_LEN}"), note
    monkeypatch.setattr(rewrite, "VERIFY_MAX_LEN", T - 1)  # too long to check in full: skipped, said so
    cm = assert_same_grads(DiagonalSSM(scan="cumprod").double(), (x,), shard_size=64)
    (note,) = _notes(cm)
    assert note.startswith("self-check skipped: the graph does not re-specialise"), note
