"""bench/bench_partial.py's core on a tiny Llama: memory, FLOPs, payloads and the time model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gradshard as gs
from tests.bench_modules import load_bench


bp = load_bench("bench_partial")
TINY = bp.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_size=48,
                      batch=2, seq_len=12)


pytestmark = pytest.mark.slow  # runs the partial-update benchmark (~40 s); `make test-all` runs it


@pytest.fixture(scope="module")
def result() -> dict:
    variants = [v for v in bp.VARIANTS if v.key in ("full", "mlp_1_4", "mlp_heads_1_4")]
    return bp.run(TINY, variants, repeat=1, comm=True, comm_world=2, log=lambda s: None)


def _rows(result: dict) -> dict[str, dict]:
    return {r["key"]: r for r in result["rows"]}


def test_sliced_rows_have_fewer_gradients_state_and_backward_flops(result: dict) -> None:
    rows = _rows(result)
    full = rows["full"]
    assert full["trainable_params"] == full["total_params"] and full["frozen_bytes"] == 0
    for key in ("mlp_1_4", "mlp_heads_1_4"):
        r = rows[key]
        assert r["trainable_params"] < full["trainable_params"]
        # gradients exist only for the trainable entries; AdamW state (2 moments + a 4-byte step
        # counter per tensor) only for them; the full weights of sliced layers have neither
        assert r["grad_bytes"] == r["trainable_bytes"] < full["grad_bytes"]
        assert r["optimizer_bytes"] == 2 * r["trainable_bytes"] + 4 * r["optimizer_tensors"]
        assert r["optimizer_bytes"] < full["optimizer_bytes"]
        # slices are views: the resident parameter bytes do not change
        assert r["resident_param_bytes"] == full["resident_param_bytes"]
        assert r["trainable_bytes"] + r["frozen_bytes"] + r["other_buffer_bytes"] == r["resident_param_bytes"]
        # forward unchanged; backward skips exactly the frozen slices' weight-gradient GEMMs
        assert r["forward_flops"] == full["forward_flops"]
        assert r["backward_flops"] < full["backward_flops"]
        assert full["backward_flops"] - r["backward_flops"] == r["predicted_backward_saved"] > 0
        assert r["per_node_bytes"] < full["per_node_bytes"]
    # slicing attention too trains strictly less than slicing the MLPs alone
    assert rows["mlp_heads_1_4"]["trainable_params"] < rows["mlp_1_4"]["trainable_params"]
    assert rows["mlp_heads_1_4"]["backward_flops"] < rows["mlp_1_4"]["backward_flops"]


def test_payloads_counted_on_real_objects(result: dict) -> None:
    rows, comms = _rows(result), {c["key"]: c for c in result["comm"]}
    full = rows["full"]
    # every-step DDP all-reduces every gradient; a DiLoCo sync the float32 delta of every parameter
    assert comms["full"]["ddp_bytes_per_step"] == full["grad_bytes"]
    assert comms["full"]["sync_bytes"] == 4 * full["total_params"]
    for key in ("mlp_1_4", "mlp_heads_1_4"):
        c = comms[key]
        assert c["syncs_seen"] == 1 and c["ddp_bytes_per_step"] is None
        # PartialDiLoCo sends dense deltas (zeros outside the trained slice): same payload as DiLoCo
        assert c["sync_bytes"] == comms["full"]["sync_bytes"]
        # ... of which this rank changed only its trained entries
        assert c["trained_entry_bytes"] == rows[key]["trainable_bytes"] < comms["full"]["trained_entry_bytes"]
        # and per step, amortised over H >= 2 steps, far less than every-step DDP
        assert c["sync_bytes"] / 20 < comms["full"]["ddp_bytes_per_step"]


def test_time_model_is_the_papers_ring_estimate(result: dict) -> None:
    # Appendix B: M = 2.6 GB, K = 32, B = 2.875 GB/s -> about 1.75 s
    assert bp.ring_allreduce_seconds(2.6e9, 32, 2.875e9) == pytest.approx(1.75, abs=0.01)
    assert bp.ring_allreduce_seconds(1000, 2, 1.0) == pytest.approx(1000.0)
    rows = _rows(result)
    sim = result["simulation"]
    assert {s["K"] for s in sim} == set(bp.NODES) and {s["gbit"] for s in sim} == set(bp.BANDWIDTHS_GBIT)
    for s in sim:
        t_comp = rows[s["key"]]["step_seconds"]
        comm = bp.ring_allreduce_seconds(s["payload"], s["K"], s["gbit"] * bp.GBIT)
        if s["method"].startswith("DDP"):
            expect = bp.STEPS * max(t_comp, comm)
        else:
            expect = bp.STEPS * t_comp + bp.STEPS / s["H"] * comm
        assert s["total_s"] == pytest.approx(expect, rel=1e-12)


def test_paper_accounting_reproduces_table1() -> None:
    for key, n, heads in (("mlp_1_2", 2, False), ("mlp_1_4", 4, False), ("mlp_1_8", 8, False),
                          ("mlp_heads_1_4", 4, True)):
        got = bp.paper_trainable_params(2048, 24, 32000, 8192, n, heads) / 1e9
        assert got == pytest.approx(bp.PAPER_TABLE1[key][1], abs=0.006), key
    # Appendix C: freezing nothing changes nothing; freezing more saves more
    assert bp.paper_step_flops(1, 1) > bp.paper_step_flops(0.5, 1) > bp.paper_step_flops(0.25, 0.25)


def test_report_section_replaces_only_its_own_section(result: dict, tmp_path: Path) -> None:
    text = bp.render(result)
    assert "1/4 MLPs + 1/4 heads" in text and "Simulated wall-clock" in text
    path = tmp_path / "RESULTS.md"
    path.write_text(f"# Benchmark results\n\n## Other (issue 1)\n\nkeep me\n\n{bp.HEADING}\n\nold\n\n## Last\n\nx\n")
    bp.write_section(bp.HEADING, text, path)
    bp.write_section(bp.HEADING, text, path)
    out = path.read_text()
    assert "keep me" in out and "## Last\n\nx" in out and "\nold\n" not in out
    assert out.count(bp.HEADING) == 1


def test_recomputation_increases_the_per_node_reduction(result: dict) -> None:
    plain = {r["key"]: r for r in result["eager_rows"]}
    rec = {r["key"]: r for r in result["recompute_rows"]}
    compiled = _rows(result)
    assert plain.keys() == rec.keys() == compiled.keys()
    for key, r in rec.items():
        p, c = plain[key], compiled[key]
        assert r["recompute"] and not p["recompute"] and r["path"] == p["path"] == "eager"
        # the same slices (checked against the compiled plan in run), the same state bytes
        for f in ("trainable_params", "grad_bytes", "optimizer_bytes", "resident_param_bytes"):
            assert r[f] == p[f] == c[f], (key, f)
        # the eager path without recomputation measures what the compiled plan measures
        assert p["per_node_bytes"] == c["per_node_bytes"] and p["flops"] == c["flops"]
        # recomputation: fewer saved activations, a lower peak, the same gradients, more backward FLOPs
        assert r["saved_bytes"] < p["saved_bytes"] and r["activation_peak_bytes"] < p["activation_peak_bytes"]
        assert r["grad_max_abs_diff"] == 0.0
        assert r["forward_flops"] == p["forward_flops"] and r["backward_flops"] > p["backward_flops"]

    def cut(rows: dict, key: str) -> float:
        return 1 - rows[key]["per_node_bytes"] / rows["full"]["per_node_bytes"]

    for key in ("mlp_1_4", "mlp_heads_1_4"):
        assert cut(rec, key) > cut(plain, key) > 0, key
    # a compiled model traces through torch.utils.checkpoint: it saves every activation again
    assert result["compiled_checkpoint_saved_bytes"] == compiled["full"]["saved_bytes"] > rec["full"]["saved_bytes"]
    text = bp.render(result)
    assert "With activation recomputation" in text and "Measured like for like" in text


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("key", ["full", "mlp_1_4", "mlp_heads_1_4"])
def test_checkpoint_layers_leaves_gradients_unchanged(key: str) -> None:
    """float64: sliced + recomputed gradients equal autograd's on the unsliced model (slices narrowed)."""
    variant = next(v for v in bp.VARIANTS if v.key == key)
    x, y = bp.make_batch(TINY)
    ref = bp.make_model(TINY).double()
    bp.lm_loss(ref, x, y).backward()
    full_grads = _grads(ref)
    saved = {}
    for recompute in (False, True):
        want = dict(full_grads)
        model = variant.slice_eager(bp.make_model(TINY, recompute=recompute).double())
        assert model.config.checkpoint_layers is recompute
        saved[recompute] = gs.measure(lambda: bp.lm_loss(model, x, y).backward(), repeat=0).saved_bytes
        got = _grads(model)
        layers = bp._sliced_layers(model)
        assert len(layers) == {"full": 0, "mlp_1_4": 3 * TINY.n_layers, "mlp_heads_1_4": 6 * TINY.n_layers}[key]
        for layer in layers:  # the trainable slice's gradient is that entry range of the full gradient
            lo, hi = layer.layout.trainable_span
            got[layer.weight_name] = got.pop(next(n for n, p in model.named_parameters() if p is layer.weight_slice))
            want_w = want[layer.weight_name].narrow(layer.layout.dim, lo, hi - lo)
            assert got[layer.weight_name].shape == want_w.shape
            want[layer.weight_name] = want_w
        assert got.keys() == want.keys()
        for n, g in got.items():
            err = float((g - want[n]).abs().max() / want[n].abs().max())
            assert err <= 1e-10, (key, recompute, n, err)
    assert saved[True] < saved[False]  # the flag really checkpoints (gradients are measured twice above)


def test_prepare_variant_refuses_recompute_on_the_compiled_path() -> None:
    with pytest.raises(ValueError, match="path='eager'"):
        bp.prepare_variant(TINY, bp.VARIANTS[0], recompute=True)


def test_sliced_mlps_recompute_their_down_projection() -> None:
    """Checkpoint early stop skips a layer's last GEMM (MLP down) for nn.Linear, not for a SlicedLinear."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    x, y = bp.make_batch(TINY)
    down = 2 * x.numel() * TINY.d_model * TINY.intermediate_size * TINY.n_layers

    def recompute_flops(key: str) -> int:
        variant = next(v for v in bp.VARIANTS if v.key == key)
        bwd = {}
        for recompute in (False, True):
            model = variant.slice_eager(bp.make_model(TINY, recompute=recompute))
            bwd[recompute] = gs.measure(lambda: bp.lm_loss(model, x, y).backward(), repeat=0).backward_flops
        return bwd[True] - bwd[False]

    full, sliced = recompute_flops("full"), recompute_flops("mlp_1_4")
    assert sliced - full == down > 0
    with set_checkpoint_early_stop(False):
        assert recompute_flops("full") == recompute_flops("mlp_1_4") == sliced
