"""Mamba-2 SSD families at a sequence length that is a multiple of their chunk size (issue 16).

The zoo's SSD mixers use ``chunk_size`` 16. At T = 37 the SSD pads time to 48 before it
reshapes it into ``(chunks, 16)`` blocks; at T = 48 or 64 nothing pads it, and the time
analysis used to lose the time axis in the blocks (the merge back made a new axis), so seco
and spaco refused bamba, granitemoehybrid and nemotron_h. Every cell here must match eager
autograd to 1e-10, with the models' float32 islands computed in float64
(:class:`tests.hf.zoo.Float64Everywhere`); the rule itself is unit-tested in
``tests/core/test_split_merge_labels.py``. The default suite runs one seco cell per affected
family; ``-m slow`` runs every plan at T = 48 and 64, the unaffected SSD families (mamba2,
zamba2, falcon_h1) too, and adjoint past its probe length (T = 160 > 134).
"""

from __future__ import annotations

import pytest

from .test_hf_plans import _run_cell
from .zoo import build, inputs

AFFECTED = ("bamba", "granitemoehybrid", "nemotron_h")
UNAFFECTED = ("mamba2", "zamba2", "falcon_h1")
PLANS = ("none", "seco", "spaco", "adjoint", "truncated_adjoint")
LENGTHS = (48, 64)

DEFAULT = [(f, 48, "seco") for f in AFFECTED] + [("bamba", 64, "spaco")]
CELLS = [(f, T, p) for f in (*AFFECTED, *UNAFFECTED) for T in LENGTHS for p in PLANS]
SLOW = [c for c in CELLS if c not in DEFAULT] + [(f, 160, "adjoint") for f in AFFECTED]


def _check(family: str, T: int, plan: str) -> None:
    _, config = build(family)
    ids = inputs(config, batch=2, T=T)["input_ids"]
    err = _run_cell(family, "sdpa", plan, float64=True, input_ids=ids)
    assert err <= 1e-10, (family, T, plan, err)


def _id(cell: tuple[str, int, str]) -> str:
    return f"{cell[0]}-T{cell[1]}-{cell[2]}"


@pytest.mark.parametrize("family, T, plan", DEFAULT, ids=[_id(c) for c in DEFAULT])
def test_ssd_family_at_a_chunk_multiple_is_exact(family: str, T: int, plan: str) -> None:
    _check(family, T, plan)


@pytest.mark.slow
@pytest.mark.parametrize("family, T, plan", SLOW, ids=[_id(c) for c in SLOW])
def test_every_plan_at_a_chunk_multiple_is_exact(family: str, T: int, plan: str) -> None:
    _check(family, T, plan)
