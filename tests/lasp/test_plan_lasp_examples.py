"""plan="lasp" on the example TransNormer-style LM: 2 and 4 threaded gloo ranks each run the
compiled model on a slice of the sequence; outputs and float64 gradients (all-reduced by the
plan) equal one process on the whole sequence (rel err <= 1e-10).

T = 23: divisible by neither the kernel block (8) nor the world sizes; batch 1 and 3; the
kernel op, the plain-torch block-wise loop and the naive masked form; constant and
data-dependent decays.
"""

from __future__ import annotations

import pytest
import torch

from examples import factories
from lasp_testing import compare_lasp

TOL = 1e-10
CASES = [
    # (factory, overrides, world, batch)
    ("linear_attention_gradshard", {}, 2, 3),  # kernel op, constant per-head decay
    ("linear_attention_gradshard", {"decay": "gated"}, 4, 1),  # kernel op, per-step gates
    ("linear_attention", {}, 4, 1),  # block-wise loop, constant decay
    ("linear_attention_gated", {}, 2, 3),  # block-wise loop, per-step gates
    ("linear_attention_naive", {"decay": "gated"}, 4, 3),  # (q k^T ⊙ exp(c_i - c_j)) v
]


@pytest.mark.parametrize("factory,overrides,world,batch", CASES)
def test_matches_single_process(factory: str, overrides: dict, world: int, batch: int) -> None:
    model, (ids,) = getattr(factories, factory)(seq_len=23, batch=batch, dtype=torch.float64, **overrides)
    cmp = compare_lasp(model, ids, world)
    assert cmp.out_err <= TOL and cmp.grad_err <= TOL, (cmp.out_err, cmp.grad_err)
    cm = cmp.results[-1][2]
    assert [r.kind for r in cm.regions].count("linear_attention") == 2
    assert cm.lasp.world_size == world and cm.lasp.stop == 23 and cm.lasp.seq_len == 23
    assert [l.layer_id for l in cm.lasp.layers] == [0, 1]
