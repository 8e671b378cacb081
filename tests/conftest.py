"""Test-wide setup: make `examples` importable and keep runs deterministic."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.manual_seed(0)

# The test files by their measured time on 2 cores (cold Inductor cache; Intel Xeon, 2026-11-29),
# longest first (order matters only for speed): `pytest -n 2 --dist loadfile --no-loadscope-reorder`
# hands the files out in this order (without that flag xdist re-sorts them by their number of tests,
# which put one-test files of a minute, the Triton interpreter's and the wheel's, last), so the short ones come last and both workers finish together (longest
# processing time first) instead of one running a long file alone at the end. Unlisted files
# (under ~14 s) follow in collection order.
LONGEST_FIRST = (
    "compose/test_compose_regions.py", "hf/test_hf_plans.py", "adjoint/test_adjoint_memory.py",
    "compose/test_compose_split.py", "core/test_compile_leftovers.py", "kernels/test_kernel_triton_interp.py",
    "core/test_first_step.py", "cost/test_validation.py", "adjoint/test_adjoint_examples.py",
    "core/test_plan_none.py", "compose/test_compose_regions_models.py", "packaging/test_wheel.py",
    "cost/test_auto_plan.py", "chunked/test_length_serving.py", "distributed/test_faults.py",
    "hf/test_hf_qwen3_next.py", "compose/test_compose_inductor.py", "adjoint/test_hf_rwkv_adjoint.py",
    "cost/test_max_seq_len.py", "cost/test_report.py", "adjoint/test_hf_xlstm_chunkwise.py",
    "adjoint/test_chunked_shards.py", "adjoint/test_length_generic.py", "chunked/test_seco_exact.py",
    "hf/test_hf_chunk_multiple.py", "adjoint/test_adjoint_models.py", "hf/test_hf_rwkv_xlstm.py",
    "hf/test_hf_fuzz.py", "hf/test_hf_serving.py", "hf/test_hf_backend.py", "adjoint/test_driven_loops.py",
    "kernels/test_kernel_scan.py", "kernels/test_kernel_lightning.py", "kernels/test_kernel_traffic.py",
    "adjoint/test_truncated.py", "hf/test_hf_partial.py", "adjoint/test_low_precision.py",
    "lasp/test_lasp_failures.py", "chunked/test_block_scans.py", "cost/test_probe.py",
    "test_measure_compiled.py", "chunked/test_spaco.py", "chunked/test_carried_loop.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        rel = Path(str(item.fspath)).resolve().relative_to(ROOT / "tests").as_posix()
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: within a file and among the rest, the collection order
