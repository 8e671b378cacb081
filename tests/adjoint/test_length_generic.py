"""A program compiled at T=32 runs at T=1000 without capturing again (gradients checked).

Loop-written models unroll at capture (about 3 ms per node: a new capture at T=1000 would
take about a minute); the compiled program is re-specialised to the new length instead,
after a one-time cross-check against a real capture at T=33.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gradshard as gs
from examples.models.ssm import LoopSSMLM, SelectiveSSMLM, SSMConfig
from gradshard.plans.adjoint.respecialize import RespecializeError, respecialize

from .helpers import grads_of, rel_err


def _count_captures(monkeypatch) -> list[int]:
    """The sequence lengths the compiled module captures at from now on (appended as they happen)."""
    import gradshard.api as capture_mod  # the capture the compiled module calls

    captures: list[int] = []
    real_capture = capture_mod.capture

    def counting(target, args, kwargs=None, **kw):
        captures.append(args[0].shape[1])
        return real_capture(target, args, kwargs, **kw)

    monkeypatch.setattr(capture_mod, "capture", counting)
    return captures


@pytest.mark.parametrize("cls", [pytest.param(LoopSSMLM, marks=pytest.mark.slow), SelectiveSSMLM])
def test_captured_at_32_runs_at_1000(cls, monkeypatch):
    torch.manual_seed(0)
    model = cls(SSMConfig(vocab_size=37, d_model=8, n_layers=2, d_state=3, learn_initial_state=True,
                          conv_kernel=4)).double()
    ref = copy.deepcopy(model)
    cm = gs.compile(model, plan="adjoint", shard_size=100)
    cm(torch.randint(0, 37, (2, 32)))
    captures = _count_captures(monkeypatch)
    ids = torch.randint(0, 37, (2, 1000), generator=torch.Generator().manual_seed(1))
    out, grads, _ = grads_of(model, (ids,), cm)
    assert cm._last.extras.get("respecialized_from") == 32
    assert captures == [33]  # only the cheap probe, never T=1000
    ref_out, ref_grads, _ = grads_of(ref, (ids,))
    assert rel_err(out[0], ref_out[0]) <= 1e-10
    for name, r in ref_grads.items():
        assert rel_err(grads[name], r) <= 1e-10, name
    # explain() and program describe the re-specialised program that ran, not the T=32 one
    first = cm.specializations[0]
    assert cm.program is not first.program and cm.graph is not first.gm
    assert cm.passes[-1].name == "respecialize_length" and cm.passes[-1].after == cm.graph.code
    assert "serving T=1000: the program compiled at T=32, re-specialised" in cm.explain()
    # a second new length reuses the verdict: no probe, no capture
    cm(torch.randint(0, 37, (2, 77)))
    assert captures == [33] and cm._last.extras.get("seq_len") == 77
    assert "serving T=77" in cm.explain()


@pytest.mark.parametrize("cls", [LoopSSMLM, SelectiveSSMLM])
def test_a_long_first_call_compiles_at_the_probe_length(cls, monkeypatch):
    """The first call at T=1000 captures the probe length (and one step more, the cross-check),
    never 1000: a per-step loop unrolls the probe's steps; capture and passes cost the same at
    every length."""
    from gradshard.plans.adjoint import PROBE_LENGTH

    torch.manual_seed(0)
    model = cls(SSMConfig(vocab_size=37, d_model=8, n_layers=2, d_state=3, conv_kernel=4)).double()
    ref = copy.deepcopy(model)
    captures = _count_captures(monkeypatch)
    cm = gs.compile(model, plan="adjoint", shard_size=100)
    ids = torch.randint(0, 37, (2, 1000), generator=torch.Generator().manual_seed(1))
    out, grads, _ = grads_of(model, (ids,), cm)
    assert captures == [PROBE_LENGTH, PROBE_LENGTH + 1]
    assert cm._last.extras.get("respecialized_from") == PROBE_LENGTH
    assert f"serving T=1000: the program compiled at T={PROBE_LENGTH}, re-specialised" in cm.explain()
    ref_out, ref_grads, _ = grads_of(ref, (ids,))
    assert rel_err(out[0], ref_out[0]) <= 1e-10
    for name, r in ref_grads.items():
        assert rel_err(grads[name], r) <= 1e-10, name


def test_a_probe_the_plan_refuses_falls_back_to_the_full_length_capture():
    """A model without a recurrence: the probe compile is refused, and so is the full one, with the
    full call's error (nothing of the probe is left cached)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).double()
    cm = gs.compile(model, plan="adjoint")
    with pytest.raises(gs.GradshardError, match="no time axis found"):
        cm(torch.randn(2, 300, 4, dtype=torch.float64))
    assert cm.specializations == ()


def test_respecialize_refuses_inconsistent_shapes():
    """A graph whose baked sizes cannot follow T fails verification instead of running wrong."""
    import torch.fx as fx

    from gradshard.plans.adjoint.respecialize import DimFact

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 8, 3)
    v = g.call_function(torch.ops.aten.view.default, (x, [16, 3]))
    v.meta["val"] = torch.empty(16, 3)
    w = g.call_function(torch.ops.aten.view.default, (v, [4, 4, 3]))  # splits B*T wrongly for other T
    w.meta["val"] = torch.empty(4, 4, 3)
    g.output(w)
    gm = fx.GraphModule(torch.nn.Module(), g)
    facts = {"x": (None, DimFact("shift", 0), None), "view_default": (DimFact("scale", 2), None),
             "view_default_1": (None, None, None)}
    with pytest.raises(RespecializeError):
        respecialize(gm, facts, 8, 10)
