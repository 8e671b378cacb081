"""detect_linear_attention on captured graphs (plan "none": analysis only, one process).

Each form is found once per layer with the right q/k/v nodes, head layout, decay and
output normalisation; softmax attention and non-causal products are not claimed.
"""

from __future__ import annotations

import pytest
import torch

import gradshard as gs
from examples import factories
from lasp_models import tiny_lm


def _regions(model: torch.nn.Module, ids: torch.Tensor, kind: str = "linear_attention") -> list:
    cm = gs.compile(model, plan="none", time_axis=(0, 1))
    entry = cm.compiled_for(ids)
    return [r for r in entry.regions if r.kind == kind], entry


@pytest.mark.parametrize("factory,form,decay", [
    ("linear_attention_gradshard", "kernel", "constant per head"),
    ("linear_attention", "blockwise", "constant per head = exp(source)"),
    ("linear_attention_naive", "masked", "constant per head = exp(source)"),
    ("linear_attention_gated", "blockwise", "per step (gates) = exp(source)"),
])
def test_example_forms(factory: str, form: str, decay: str) -> None:
    model, (ids,) = getattr(factories, factory)(seq_len=21, dtype=torch.float64)
    found, entry = _regions(model, ids)
    assert len(found) == 2  # one per layer
    for r in found:
        o = r.options
        assert (o["form"], o["decay"], o["heads"], o["dk"], o["dv"]) == (form, decay, 4, 8, 8)
        assert o["output_norm"].startswith("rms")
        assert o["state_bytes"] == 2 * 4 * 8 * 8 * 8
        assert r.source is not None and r.source.file.endswith("linear_attention.py")
        for role in ("q", "k", "v"):
            assert o[role] in r.inputs
    assert found[0].options["q"] != found[1].options["q"]


@pytest.mark.parametrize("impl,decay,form,expect", [
    ("naive", "none", "masked", "none"),
    ("naive", "const", "masked", "constant per head"),
    ("einsum", "gated", "masked", "per step (gates) = exp(source)"),
    ("recurrent", "const", "recurrent", "constant per head"),
    ("recurrent", "gated", "recurrent", "per step (gates) = exp(source)"),
])
def test_other_forms(impl: str, decay: str, form: str, expect: str) -> None:
    model, ids = tiny_lm(impl, decay, seq_len=11, batch=2)
    found, entry = _regions(model, ids)
    assert len(found) == 2
    nodes = {n.name: n for n in entry.captured.gm.graph.nodes}
    for r, f in zip(found, entry.ctx.analyses["linear_attention"].findings):
        assert r.options["form"] == form and r.options["decay"] == expect
        if impl == "einsum":
            assert r.options["layout"] == "(B,T,H,d)"
        for role, layout in (("q", f.spec.q), ("k", f.spec.k), ("v", f.spec.v)):
            val = nodes[r.options[role]].meta["val"]
            assert tuple(layout.to_canonical(val).shape) == (2, 2, 11, 3)  # (B, H, T, d)
        if decay == "const":  # λ = sigmoid(θ) is a parameter: its node is kept, not baked
            assert r.options["decay_source"] != "constant in the code"


def test_cumsum_form_reports_states_and_normaliser() -> None:
    model, ids = tiny_lm("cumsum", "none", seq_len=11, batch=2)
    found, entry = _regions(model, ids)
    assert len(found) == 2 and all(r.options["form"] == "cumsum" for r in found)
    assert all("k" in r.options and "v" in r.options for r in found)
    prefix, _ = _regions(model, ids, kind="prefix_sum")
    assert prefix == []  # the normaliser cumsum(k) is handled by the lasp rewrite, not reported here


@pytest.mark.parametrize("impl", ["softmax", "noncausal"])
def test_not_linear_attention_is_not_claimed(impl: str) -> None:
    model, ids = tiny_lm(impl, "none", seq_len=11, batch=2)
    found, entry = _regions(model, ids)
    assert found == []
    analysis = entry.ctx.analyses["linear_attention"]
    assert analysis.rejections and analysis.findings == []
