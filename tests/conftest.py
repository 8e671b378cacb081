"""Test-wide setup: make `examples` importable and keep runs deterministic."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.manual_seed(0)

# The test files by their measured time on 2 cores (cold Inductor cache; Intel Xeon, 2026-11-30),
# longest first (order matters only for speed): `pytest -n 2 --dist loadfile --no-loadscope-reorder`
# hands the files out in this order, so the short ones come last and both workers finish together
# (longest processing time first). Without that flag xdist re-sorts the files by their number of
# tests, which put one-test files of half a minute (the Triton interpreter's, the wheel's) last:
# 809 s of pytest then, 661 s with it. Unlisted files (under ~6 s) follow in collection order.
LONGEST_FIRST = (
    "compose/test_compose_regions.py", "hf/test_hf_plans.py", "compose/test_compose_split.py",
    "adjoint/test_adjoint_memory.py", "core/test_compile_leftovers.py", "packaging/test_wheel.py",
    "kernels/test_kernel_triton_interp.py", "compose/test_compose_regions_models.py",
    "distributed/test_faults.py", "hf/test_hf_fuzz.py", "adjoint/test_hf_rwkv_adjoint.py",
    "hf/test_hf_qwen3_next.py", "compose/test_compose_inductor.py", "core/test_first_step.py",
    "cost/test_report.py", "hf/test_hf_serving.py", "cost/test_validation.py",
    "chunked/test_length_serving.py", "hf/test_hf_backend.py", "cost/test_max_seq_len.py",
    "core/test_plan_none.py", "adjoint/test_hf_xlstm_chunkwise.py", "cost/test_auto_plan.py",
    "hf/test_hf_chunk_multiple.py", "chunked/test_seco_exact.py", "lasp/test_lasp_failures.py",
    "hf/test_hf_rwkv_xlstm.py", "adjoint/test_chunked_shards.py", "adjoint/test_adjoint_models.py",
    "cost/test_probe.py", "kernels/test_kernel_traffic.py", "test_measure_compiled.py",
    "lasp/test_plan_lasp_forms.py", "core/test_state_properties.py", "lasp/test_plan_lasp_examples.py",
    "chunked/test_spaco.py", "adjoint/test_length_generic.py", "adjoint/test_driven_loops.py",
    "lasp/test_detect_linear_attention.py", "adjoint/test_low_precision.py", "chunked/test_block_scans.py",
    "hf/test_hf_partial.py", "chunked/test_dry_run_meta.py", "adjoint/test_adjoint_examples.py",
    "chunked/test_carried_loop.py", "adjoint/test_detection.py", "chunked/test_kept_chunk.py",
    "hf/test_hf_autocast.py", "test_bench_interleaved.py", "test_plan_partial.py",
    "chunked/test_chunked_memory.py", "adjoint/test_truncated.py", "distributed/test_lasp_runtime.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        rel = Path(str(item.fspath)).resolve().relative_to(ROOT / "tests").as_posix()
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: within a file and among the rest, the collection order
