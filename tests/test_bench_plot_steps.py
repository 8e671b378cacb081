"""bench/plot_steps.py draws step memory / time vs T from rows; bench_compose's ``ckpt`` method is exact."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.bench_modules import load_bench

bc = load_bench("bench_compose")
ps = load_bench("plot_steps")

MIB = 1024 ** 2
LENS = (1024, 2048, 4096, 8192)
PLANS = {"ssm": ("gs_adjoint", "gs_adjoint_eager"), "llama": ("gs_seco", "gs_seco_eager")}


def fixed_rows() -> list[dict]:
    """Rows as bench_compose writes them, with made-up numbers (no benchmarking)."""
    rows = []
    for model, plans in PLANS.items():
        for T in LENS:
            for j, method in enumerate(("eager", "ckpt", "compile", "compile_budget", *plans)):
                rows.append({"model": model, "model_desc": f"{model} model: d=64", "method": method, "T": T,
                             "batch": 1, "device": "cpu", "peak": (j + 1) * T * 1000 + 7,
                             "seconds": 0.001 * (j + 1) * T / 1024, "first_call_s": 1.0})
    return rows


def test_plot_draws_one_line_per_method_per_model_and_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install gradshard[plot])")
    rows = fixed_rows()
    fig = ps.draw(rows, ps.caption(rows))
    axes = fig.get_axes()
    assert len(axes) == 4  # a (memory, time) row per model
    for (mem, time), model in zip(zip(axes[::2], axes[1::2]), PLANS):
        want = [ps.STYLE[m][0] for m in ("eager", "ckpt", "compile", "compile_budget", *PLANS[model])]
        for ax, key, unit in ((mem, "peak", "MiB"), (time, "seconds", "(s)")):
            assert [line.get_label() for line in ax.get_lines()] == want
            assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
            assert unit in ax.get_ylabel() and "tokens" in ax.get_xlabel() and model in ax.get_title()
            for line, method in zip(ax.get_lines(), ("eager", "ckpt", "compile", "compile_budget", *PLANS[model])):
                pts = sorted((r["T"], r[key]) for r in rows if r["model"] == model and r["method"] == method)
                assert list(line.get_xdata()) == list(LENS)
                scale = MIB if key == "peak" else 1
                assert list(line.get_ydata()) == pytest.approx([v / scale for _, v in pts])
    assert "batch 1, CPU" in fig._suptitle.get_text()

    # the script: rows file in, PNG out, a section of its own linking it (compose's section is left alone)
    src, png, results = tmp_path / "rows.json", tmp_path / "steps_vs_T.png", tmp_path / "RESULTS.md"
    src.write_text(json.dumps(rows))
    results.write_text(f"# Benchmark results\n\n{bc.HEADING}\n\ntable\n\n## Next\n\nkept\n")
    assert ps.main(["--rows", str(src), "--png", str(png), "--out", str(results)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    h, w = matplotlib.image.imread(png).shape[:2]
    assert (w, h) == (1300, 840)
    text = results.read_text()
    assert f"{bc.HEADING}\n\ntable\n\n## Next\n\nkept\n" in text
    assert f"{ps.HEADING}\n\n![" in text and "](steps_vs_T.png)" in text


def test_plot_without_rows_says_how_to_make_them(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install gradshard[plot])")
    with pytest.raises(SystemExit, match="gradshard bench compose"):
        ps.main(["--rows", str(tmp_path / "missing.json"), "--no-write"])


def _saved_bytes_and_grads(model: nn.Module, run, ids: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = run(ids)
    labels = torch.roll(ids, -1, 1)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    return sum(saved), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", bc.MODELS)
def test_ckpt_gives_eager_gradients_and_saves_less(name: str) -> None:
    if name.startswith("hf_"):
        pytest.importorskip("transformers", reason=f"the {name} model needs transformers (gradshard[dev])")
    model, ids, _ = bc.make_model(name, 16, 2)
    model = model.double()
    ckpt_model = copy.deepcopy(model)
    run, label = bc.runner("ckpt", ckpt_model, shard=8, chunk=8)
    assert "checkpointing" in label
    if not name.startswith("hf_"):  # transformers checkpoints its own layers
        assert sum(isinstance(m, bc.Checkpointed) for m in ckpt_model.modules()) == 4  # the 4 blocks
    eager_saved, eager = _saved_bytes_and_grads(model, model, ids)
    ckpt_saved, ckpt = _saved_bytes_and_grads(ckpt_model, run, ids)
    assert ckpt_saved < eager_saved / 2, (ckpt_saved, eager_saved)  # the blocks' activations are recomputed
    assert len(ckpt) == len(eager) and all(g is not None for g in eager + ckpt)
    for a, b in zip(ckpt, eager):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max().clamp_min(1e-30)


def test_ckpt_needs_a_layer_list() -> None:
    with pytest.raises(ValueError, match="no nn.ModuleList of layers"):
        bc.checkpoint_layers(nn.Sequential(nn.Linear(3, 3)))
