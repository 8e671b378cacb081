"""plan="adjoint" on the project's SSM language models (examples/models/ssm.py), float64.

Every way the recurrence is written (per-step loop, log-space cumsum, associative_scan,
gradshard.kernels.linear_scan), the three recurrence kinds (diagonal, scalar per head with a
causal conv1d, dense), batch 1 and 3, with and without a learned initial state; T=13 with
shards of 4. Gradients of every parameter equal autograd's to 1e-10 (relative).
"""

from __future__ import annotations

import pytest
import torch

from examples.models.ssm import LoopSSMLM, SelectiveSSMLM, SSMConfig

from .helpers import assert_same_grads

T = 13
SMALL = dict(vocab_size=37, d_model=8, n_layers=2, d_state=3, n_heads=2)

VARIANTS = {
    "loop": (LoopSSMLM, {}),
    "logcumsum": (SelectiveSSMLM, {"scan": "loop_free_logcumsum"}),
    "associative_scan": (SelectiveSSMLM, {"scan": "associative_scan"}),
    "linear_scan": (SelectiveSSMLM, {"scan": "gradshard"}),
    "scalar_conv": (SelectiveSSMLM, {"decay": "scalar", "conv_kernel": 4}),
    "loop_scalar_conv": (LoopSSMLM, {"decay": "scalar", "conv_kernel": 4}),
    "dense_loop": (LoopSSMLM, {"decay": "dense", "scan": "associative_scan"}),
    "dense_associative": (SelectiveSSMLM, {"decay": "dense", "scan": "associative_scan"}),
}


def _model(name: str, h0: bool) -> torch.nn.Module:
    cls, extra = VARIANTS[name]
    torch.manual_seed(0)
    model = cls(SSMConfig(**SMALL, **extra, learn_initial_state=h0)).double()
    return model


def _example_cells():
    """Every scan form at one of (batch 1, no h0) / (batch 3, learned h0), alternating; the other
    setting runs in `make test-all` (the default suite stays under 15 min on 2 cores)."""
    for i, name in enumerate(sorted(VARIANTS)):
        for j, (batch, h0) in enumerate([(1, False), (3, True)]):
            marks = () if (i + j) % 2 == 0 else (pytest.mark.slow,)
            yield pytest.param(name, batch, h0, marks=marks, id=f"{batch}-{h0}-{name}")


@pytest.mark.parametrize("name,batch,h0", list(_example_cells()))
def test_ssm_lm_adjoint_exact(name, batch, h0):
    model = _model(name, h0)
    ids = torch.randint(0, SMALL["vocab_size"], (batch, T), generator=torch.Generator().manual_seed(batch))
    cm = assert_same_grads(model, (ids,), shard_size=4)
    regions = [r for r in cm.regions if r.kind == "linear_recurrence"]
    assert len(regions) == SMALL["n_layers"], [r.describe() for r in regions]
