"""The CostReport API, plan comparison tables and the helpers the CLI wires."""

import math

import pytest
import sympy
import torch

import gradshard as gs
from examples import factories as F
from gradshard.cost import (CostReport, compare_plans, cost, cost_table, max_seq_len_table,
                            parse_plans, plot_memory_vs_seq_len)
from gradshard.cost.fit import B, T
from gradshard.cost.report import QUANTITIES


@pytest.fixture(scope="module")
def report() -> CostReport:
    target, inputs = F.llama(seq_len=32)
    return cost(target, "none", example_inputs=inputs, device="h100")


def test_gs_cost_is_callable_through_the_package():
    target, inputs = F.ssm_gradshard_scan(seq_len=16)
    import gradshard.cost  # noqa: F401  # importing the subpackage must not break gs.cost(...)

    rep = gs.cost(target, plan="none", example_inputs=inputs)
    assert isinstance(rep, CostReport) and rep.fits["peak_bytes"].exact


def test_expressions_are_sympy_in_batch_and_seq_len(report):
    assert list(report.expressions) == list(QUANTITIES)
    peak = report.expressions["peak_bytes"]
    assert isinstance(peak, sympy.Expr) and peak.free_symbols <= {B, T}
    assert report.expressions["flops"].free_symbols == {B, T}
    assert report.expressions["flops"].as_poly(B, T).degree(T) == 2  # attention is quadratic in T
    assert report.expressions["param_bytes"].free_symbols == set()
    assert "B*T" in report.formula("activation_bytes")
    assert all(f.exact for f in report.fits.values())


def test_evaluate(report):
    small, big = report.evaluate(seq_len=1000, batch=1), report.evaluate(seq_len=2000, batch=1)
    assert set(small) == set(QUANTITIES) | {"time_s"}
    assert big["activation_bytes"] == 2 * small["activation_bytes"]  # activations are linear in T here
    assert big["flops"] > 2 * small["flops"]  # ... FLOPs are not
    assert small["total_bytes"] == (small["param_bytes"] + small["optimizer_bytes"] + small["input_bytes"]
                                    + small["peak_bytes"])
    assert small["optimizer_bytes"] == 2 * small["grad_bytes"]  # adamw: two states per trainable parameter
    assert small["flops"] == small["flops_fwd"] + small["flops_bwd"] and small["comm_bytes"] == 0
    assert report.evaluate()["peak_bytes"] == report.evaluate(seq_len=32, batch=2)["peak_bytes"]
    assert report.evaluate(seq_len=10**6, batch=8)["peak_bytes"] > 10**10
    with pytest.raises(TypeError, match="world_size"):
        report.evaluate(seq_len=10, world_size=2)


def test_max_seq_len_is_the_boundary(report):
    for budget in ("80GB", 10**8, 3 * 10**6):
        t = report.max_seq_len(budget, batch=4)
        need = lambda n: report.evaluate(n, 4)["total_bytes"]  # noqa: E731
        limit = gs.cost.parse_bytes(budget) if isinstance(budget, str) else budget
        assert t > 0 and need(t) <= limit < need(t + 1)
    assert report.max_seq_len(batch=8) == report.max_seq_len(80 * 2**30, batch=8)  # the device's memory
    assert report.max_seq_len(1000, batch=1) == 0
    t = report.max_seq_len(10**8, batch=2, multiple_of=512)
    assert t % 512 == 0 and report.evaluate(t + 512, 2)["total_bytes"] > 10**8


def test_time_estimate_is_a_labelled_roofline(report):
    est = report.time_estimate(seq_len=65536, batch=8)
    assert "roofline estimate" in est.label and est.seconds > 0 and est.bound in ("compute", "memory")
    slow = report.time_estimate(seq_len=65536, batch=8, device="rtx3090")
    assert slow.seconds > est.seconds
    assert report.evaluate(65536, 8)["time_s"] == pytest.approx(est.seconds)


def test_describe_and_to_dict(report):
    text = report.describe(seq_len=4096, batch=8)
    assert "peak_bytes" in text and "roofline" in text and "exact on all probes" in text
    d = report.to_dict(seq_len=4096, batch=8)
    assert d["plan"] == "none" and d["values"]["flops"] > 0 and "T" in d["formulas"]["flops"]


def test_parse_plans():
    reqs = parse_plans("none,seco:chunk_size=512:budget=4k,partial_update:targets=mlp")
    assert [r.plan for r in reqs] == ["none", "seco", "partial_update"]
    assert reqs[1].options == {"chunk_size": 512, "budget": 4000} and reqs[1].label == "seco(chunk_size=512, budget=4000)"
    assert parse_plans([("seco", {"chunk_size": 8})])[0].options == {"chunk_size": 8}
    with pytest.raises(ValueError, match="name=value"):
        parse_plans("seco:512")


def test_tables(report):
    table = cost_table([report], ["1k", 65536, "10M"], batch=8, device="h100")
    assert [r["seq_len"] for r in table.rows] == [1000, 65536, 10**7]
    assert table.rows[0]["fits"] and not table.rows[-1]["fits"]
    assert len(table.formatted()[0]) == len(table.columns) and "GiB" in table.to_markdown()
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(table)
    assert "roofline" in console.export_text()
    whatif = max_seq_len_table([report], "80GB", batch=8)
    assert whatif.rows[0]["max_seq_len"] == report.max_seq_len(80 * 10**9, batch=8)


@pytest.mark.slow  # default suite under 15 min on 2 cores; runs in `make test-all` (the wheel test runs `gradshard cost`)
def test_compare_plans_prices_each_plan():
    target, inputs = F.llama(seq_len=16)
    plans = ["none"] + (["partial_update:slice_index=0"] if "partial_update" in gs.plans() else [])
    table = compare_plans(target, plans, inputs, ["1k", "4k"], device="a100", common_options={"num_slices": 2},
                          optimizer="sgd")
    assert len(table.rows) == 2 * len(plans)
    assert [r["plan"] for r in table.rows][-1] == plans[-1].replace(":slice_index=0", "(num_slices=2, slice_index=0)") \
        if len(plans) > 1 else "none"
    if len(plans) > 1:  # fewer trainable weights: fewer gradient bytes and backward FLOPs
        none, part = table.rows[0], table.rows[2]
        assert part["total_bytes"] < none["total_bytes"] and part["flops"] < none["flops"]


@pytest.mark.slow  # keeps the default suite under 15 min on 2 cores; `make test-all` runs it
def test_dtype_what_if_halves_activation_bytes(report):
    target, inputs = F.llama(seq_len=32)
    f32 = report
    bf16 = cost(target, "none", example_inputs=inputs, dtype=torch.bfloat16)
    a, b = f32.evaluate(1024, 4), bf16.evaluate(1024, 4)
    assert b["param_bytes"] * 2 == pytest.approx(a["param_bytes"], rel=1e-3)
    assert 0.4 < b["activation_bytes"] / a["activation_bytes"] < 0.6
    assert bf16.dtype == "bfloat16" and target.lm_head.weight.dtype == torch.float32


def test_plot(report, tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_memory_vs_seq_len([report], tmp_path / "mem.png", device="h100")
    assert out.exists() and out.stat().st_size > 1000


def test_plot_without_matplotlib_says_how_to_install(report, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mpl(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(ImportError, match="gradshard\\[plot\\]"):
        plot_memory_vs_seq_len(report, tmp_path / "x.png")


def test_bad_inputs_fail_clearly():
    target, inputs = F.llama(seq_len=16)
    with pytest.raises(TypeError, match="tuple"):
        cost(target, "none", example_inputs=inputs[0])
    with pytest.raises(gs.GradshardError, match="no option"):
        cost(target, "none", example_inputs=inputs, chunk_size=3)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with pytest.raises(gs.GradshardError, match="time_axis"):
        cost(mlp, "none", example_inputs=(torch.randn(2, 8, 4),))
    rep = cost(mlp, "none", example_inputs=(torch.randn(2, 8, 4),), time_axis=(0, 1))
    assert math.isclose(rep.evaluate(seq_len=80, batch=2)["flops"], 10 * rep.evaluate(seq_len=8, batch=2)["flops"])
