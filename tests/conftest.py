"""Test-wide setup: make `examples` importable and keep runs deterministic."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.manual_seed(0)

# The files that take longest on 2 cores (measured; order matters only for speed): run first, so
# that `pytest -n 2 --dist loadfile` hands out the short files last and both workers finish
# together instead of one waiting on a long file picked up at the end.
LONGEST_FIRST = (
    "compose/test_compose_regions.py", "cost/test_first_step_cost.py", "cost/test_rules.py",
    "compose/test_compose_inductor.py", "kernels/test_kernel_triton_interp.py", "cost/test_validation.py",
    "cost/test_auto_plan.py", "hf/test_hf_serving.py", "packaging/test_wheel.py", "hf/test_hf_plans.py",
    "cost/test_report.py", "kernels/test_kernel_lightning_fused.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        rel = Path(str(item.fspath)).resolve().relative_to(ROOT / "tests").as_posix()
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: within a file and among the rest, the collection order
