"""bench/bench_partial.py's core on a tiny Llama: memory, FLOPs, payloads and the time model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_partial", ROOT / "bench" / "bench_partial.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_partial"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


bp = _load_bench()
TINY = bp.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_size=48,
                      batch=2, seq_len=12)


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
    bp.write_section(text, path)
    bp.write_section(text, path)
    out = path.read_text()
    assert "keep me" in out and "## Last\n\nx" in out and "\nold\n" not in out
    assert out.count(bp.HEADING) == 1
