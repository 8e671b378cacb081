"""Capture front doors, metadata, and the errors for what cannot be captured."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gradshard as gs
from gradshard.capture import capture

from .models import DataDependent, SDPABlock


def test_every_node_has_shape_and_source_metadata():
    cap = capture(SDPABlock(), (torch.randn(2, 5, 8),))
    for node in cap.gm.graph.nodes:
        if node.op in ("placeholder", "call_function"):
            assert "val" in node.meta, node.name
    linears = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linears and all("models.py" in n.meta["stack_trace"] for n in linears)
    assert any("qkv" in str(n.meta.get("nn_module_stack", {})) for n in linears)
    names = [n.meta["gs_input_name"] for n in cap.gm.graph.find_nodes(op="placeholder")]
    assert names[:2] == ["norm.weight", "norm.bias"] and names[-1] == "input0"


def test_stack_traces_hold_the_models_frames_not_the_callers():
    """Node stack traces are the model's ``forward`` frames; a caller's own ``forward`` below the
    capture (a wrapper that compiles inside its forward) is not the model's code."""

    class Caller(nn.Module):
        def forward(self, model: nn.Module, x: torch.Tensor):
            return capture(model, (x,))

    cap = Caller()(SDPABlock(), torch.randn(2, 5, 8))
    traces = [n.meta["stack_trace"] for n in cap.gm.graph.nodes if n.op == "call_function" and n.meta.get("stack_trace")]
    assert traces and all("models.py" in t for t in traces)
    assert not any("test_capture.py" in t for t in traces), traces[0]


@pytest.mark.parametrize("frontend", ["python", "fx", "dynamo"])
def test_front_doors_agree(frontend):
    model = SDPABlock().double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    cm = gs.compile(model, frontend=frontend)
    assert torch.allclose(cm(x), model(x), rtol=1e-13, atol=0)


def test_fx_front_door_fails_clearly_on_shape_loops():
    class Loop(nn.Module):
        def forward(self, x):
            return torch.stack([x[:, t] * 2 for t in range(x.shape[1])], 1)

    with pytest.raises(gs.CaptureError, match="frontend='python'"):
        gs.compile(Loop(), frontend="fx")(torch.randn(2, 3, 4))


def test_data_dependent_control_flow_names_the_line():
    with pytest.raises(gs.CaptureError) as err:
        gs.compile(DataDependent())(torch.randn(2, 5, 8))
    msg = str(err.value)
    assert "models.py" in msg and "if y.sum() > 0" in msg
    assert "torch.where" in msg


def test_closure_captured_parameters_are_rejected():
    inner = nn.Linear(4, 4)

    def fn(x):
        return inner(x).cumsum(1)

    with pytest.raises(gs.CaptureError, match="not a parameter of any module passed in"):
        gs.compile(fn)(torch.randn(2, 3, 4))


def test_unknown_plan_and_bad_options():
    with pytest.raises(gs.GradshardError, match="unknown plan"):
        gs.compile(nn.Linear(2, 2), plan="nope")
    with pytest.raises(gs.GradshardError, match="has no option"):
        gs.compile(nn.Linear(2, 2), plan="none", window=3)


def test_inspection_before_first_call_explains_itself():
    cm = gs.compile(nn.Linear(2, 2))
    with pytest.raises(gs.GradshardError, match="first call"):
        cm.regions


def test_explain_and_pass_records():
    cm = gs.compile(SDPABlock())
    cm(torch.randn(2, 5, 8))
    text = cm.explain()
    assert "annotate_time_locality" in text and "time axis: input0[dim 1]" in text
    assert "scaled_dot_product_attention" in text or "attention" in text
    # a model without a traced (T, T) mask: the mask simplification and the analysis change nothing
    assert [r.name for r in cm.passes[:2]] == ["simplify_attention_masks", "annotate_time_locality"]
    assert not cm.passes[0].changed and not cm.passes[1].changed
    assert cm.trace("detect_regions") == cm.passes[-1].after
    assert cm.program.forward and cm.program.backward
    assert cm.program.total_flops > 0
