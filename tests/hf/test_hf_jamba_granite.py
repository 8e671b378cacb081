"""jamba and granitemoehybrid (Mamba/Mamba-2 mixers, attention and top-k MoE layers) under
every plan that applies.

Both route tokens through a mixture of experts that flattens ``(batch, time)`` into one row
dim (``hidden_states.view(-1, hidden)``), repeats each row once per chosen expert and sums
the expert outputs back before ``reshape(batch, time, hidden)``. The dims rules keep time
through that route (``tests/core/test_token_routing_dims.py`` checks them on a small model),
so jamba's unrolled Mamba loop is rolled into one scan and granitemoehybrid's SSD block form
is recognised. The default suite runs one cell; ``-m slow`` runs all of them.
"""

from __future__ import annotations

import pytest

from .test_hf_plans import _run_cell, _tolerance

FAMILIES = ("jamba", "granitemoehybrid")
PLANS = ("seco", "spaco", "adjoint", "truncated_adjoint")

# one default cell (the suite's time budget): the SSD + MoE path; jamba's loop + MoE path is
# covered in the default suite by tests/core/test_token_routing_dims.py
DEFAULT = [("granitemoehybrid", "eager", "adjoint")]
CELLS = [(f, a, p) for f in FAMILIES for a in ("sdpa", "eager") for p in PLANS]
SLOW = [c for c in CELLS if c not in DEFAULT]


def _check(family: str, attn: str, plan: str) -> None:
    err = _run_cell(family, attn, plan)
    assert err <= _tolerance(family, attn), (family, attn, plan, err)


@pytest.mark.parametrize("family, attn, plan", DEFAULT, ids=["-".join(c) for c in DEFAULT])
def test_family_is_exact(family: str, attn: str, plan: str) -> None:
    _check(family, attn, plan)


@pytest.mark.slow
@pytest.mark.parametrize("family, attn, plan", SLOW, ids=["-".join(c) for c in SLOW])
def test_every_plan_is_exact(family: str, attn: str, plan: str) -> None:
    _check(family, attn, plan)
