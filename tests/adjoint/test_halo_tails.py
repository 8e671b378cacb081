"""plan="adjoint": time-local segments with a causal conv (a halo), and right padding dropped.

A Mamba-style layer whose conv output feeds both the scan and a skip connection outside it
(Mamba-2's ``D * x``, added on values padded to a block multiple and cut back): the conv
cannot join the region's producers, so it runs in a time-local segment whose shards start
``kernel - 1`` steps early (``LocalSegment.halo``); the skip's ``pad`` / ``slice`` pair is
dropped by ``drop_right_padding`` so the skip joins the segment after the scan. Neither the
conv's input and output nor a padded copy is kept for the backward. Float64, odd lengths.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradshard as gs

from .helpers import assert_same_grads

D, K, BLOCK, VOCAB = 6, 4, 4, 13


class PaddedSkipLM(nn.Module):
    """``scaled_residual``: ``h = g * h + out(...)``; the plain ``h + out(...)`` lets the region take
    the whole layer in (the residual add joins it, so the conv becomes one of its producers)."""

    def __init__(self, layers: int = 2, scaled_residual: bool = True) -> None:
        super().__init__()
        self.res_scale = nn.Parameter(torch.full((D,), 0.9)) if scaled_residual else None
        self.emb = nn.Embedding(VOCAB, D)
        self.inp = nn.ModuleList(nn.Linear(D, 2 * D) for _ in range(layers))
        self.conv = nn.ModuleList(nn.Conv1d(D, D, K, groups=D, padding=K - 1) for _ in range(layers))
        self.A = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        self.skip = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.out = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        T = ids.shape[1]
        pad = (-T) % BLOCK
        for inp, conv, A, out in zip(self.inp, self.conv, self.A, self.out):
            x, gate = inp(F.rms_norm(h, (D,))).split([D, D], dim=-1)
            x = F.silu(conv(x.transpose(1, 2))[..., :T].transpose(1, 2))
            s = gs.kernels.linear_scan(torch.sigmoid(A(x)), x * x.tanh(), None)
            y = (F.pad(s, (0, 0, 0, pad)) + self.skip * F.pad(x, (0, 0, 0, pad)))[:, :T]
            h = (h if self.res_scale is None else self.res_scale * h) + out(y * F.silu(gate))
        return self.head(F.rms_norm(h, (D,)))


@pytest.mark.parametrize("T", [11, 12])  # padded by 1 step, and by none
def test_conv_runs_in_a_halo_segment_and_the_padded_skip_joins_it(T: int) -> None:
    torch.manual_seed(0)
    model = PaddedSkipLM().double()
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(T))
    cm = assert_same_grads(model, (ids,), plan="adjoint", shard_size=3)
    segments = [r for r in cm.regions if r.kind == "local_recompute"]
    assert any(r.options.get("halo") == K - 1 and any("conv" in n for n in r.nodes) for r in segments), segments
    assert "drop_right_padding" in cm.explain()

    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        cm(ids)
    conv_layout = [s for s in saved if len(s) == 3 and s[1] == D and s[2] in (T, T + K - 1)]
    padded = [s for s in saved if len(s) >= 2 and s[1] == T + (-T) % BLOCK != T]
    assert not conv_layout and not padded, saved


@pytest.mark.parametrize("scaled_residual", [True, False], ids=["halo_segment", "halo_region"])
def test_a_halo_matches_autograd_with_shards_shorter_than_the_halo(scaled_residual: bool) -> None:
    """Shards of 2 steps read 3 earlier ones: a window spans several earlier shards (in a
    time-local segment, or in a region whose input gradient is written into its output's)."""
    torch.manual_seed(1)
    model = PaddedSkipLM(layers=2, scaled_residual=scaled_residual).double()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    cm = assert_same_grads(model, (ids,), plan="adjoint", shard_size=2)
    donated = "written into the gradient of output" in cm.explain()
    assert donated != scaled_residual, cm.explain()
