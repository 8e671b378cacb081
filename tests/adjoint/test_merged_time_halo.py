"""plan="adjoint" with a halo and a producer value whose time axis is merged into rows.

Qwen3-Next's readout normalises per (batch, step, head) row: the scan's output and the gate
``silu(z)`` are both reshaped to ``(B*T*H, head_dim)`` before the gated norm, and the causal
conv before the scan gives every shard a halo. The gate reaches the readout as a producer
output with time merged between batch and head, so the shard's halo is trimmed from the
middle factor of those rows (``RegionIO.producer_merged``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradshard as gs

from .helpers import assert_same_grads
from .models import init_like_training


class GatedRowsSSM(nn.Module):
    """Causal conv (width 3) -> per-head diagonal scan of ``b ⊗ v`` -> readout normalised and
    gated per ``(batch, step, head)`` row (the gate computed from the layer input), then the
    output projection; as Qwen3-Next's ``Qwen3NextRMSNormGated`` after its gated delta rule."""

    def __init__(self, d: int = 6, n: int = 3, heads: int = 2, p: int = 4) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.conv = nn.Conv1d(d, d, 3, groups=d, padding=2)
        self.A, self.B, self.C = nn.Linear(d, heads), nn.Linear(d, n), nn.Linear(d, n)
        self.V, self.Z, self.O = nn.Linear(d, heads * p), nn.Linear(d, heads * p), nn.Linear(heads * p, d)
        self.w = nn.Parameter(torch.ones(p))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        B, T, _ = y.shape
        x = F.silu(self.conv(y.transpose(1, 2))[..., :T].transpose(1, 2))
        a = torch.sigmoid(self.A(x))[..., None, None]
        u = self.B(x)[:, :, None, :, None] * self.V(x).unflatten(-1, (self.heads, -1))[:, :, :, None, :]
        h = gs.kernels.linear_scan(a.expand_as(u), u, None)
        rows = torch.einsum("btn,bthnp->bthp", self.C(x), h).reshape(-1, self.p)
        rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        gate = F.silu(self.Z(y).unflatten(-1, (self.heads, -1))).reshape(-1, self.p)  # rows (b, t, h)
        return y + self.O((rows * gate).reshape(B, T, -1))


@pytest.mark.parametrize("plan, options", [("adjoint", {"shard_size": 4}),
                                           ("truncated_adjoint", {"shard_size": 4, "window": 100})])
@pytest.mark.parametrize("batch", [1, 3])
def test_halo_is_trimmed_from_rows_merging_batch_time_and_head(plan: str, options: dict, batch: int) -> None:
    torch.manual_seed(1)
    x = torch.randn(batch, 11, 6, dtype=torch.float64)
    model = init_like_training(GatedRowsSSM())
    cm = assert_same_grads(model, (x,), plan=plan, **options)
    regions = [r for r in cm.regions if r.kind == "linear_recurrence"]
    assert [r.options["halo"] for r in regions] == ["2/0"]
