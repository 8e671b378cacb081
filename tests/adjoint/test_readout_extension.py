"""A region goes on past its readout's contraction only where its boundary gets narrower.

A layer ``x -> scan -> y = C h -> out_proj -> back -> residual add`` whose scan runs over the
layer input's own channels (``y`` is as wide as ``x``, as Mamba's ``heads x head_dim`` channels are
its conv's): when ``out_proj`` narrows the channels the region ends after it (no readout ``y`` is kept
between layers); when it widens them (and ``back`` only returns to the model width: no gain)
the region ends at the contraction as before -- unless the layer ends in its residual add, which
the region then takes in (the same boundary bytes, and its backward writes the input's gradient
into the output's). All exact against autograd (float64, odd shapes, shards that do not divide T).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradshard as gs
from gradshard.kernels import linear_scan

from .helpers import assert_same_grads


class Layer(nn.Module):
    def __init__(self, d: int, n: int, out: int, residual: bool = True) -> None:
        super().__init__()
        self.residual = residual
        self.to_b, self.to_c = nn.Linear(d, n), nn.Linear(d, n)
        self.decay = nn.Parameter(torch.randn(d))  # per channel: the scan's channels are x's own
        self.out_proj = nn.Linear(d, out)
        self.back = nn.Linear(out, d)  # back to the model width: never narrower than y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(x * self.decay)[..., None]  # (B, T, d, 1)
        u = x[..., None] * self.to_b(x)[..., None, :]  # (B, T, d, n)
        h = linear_scan(a, u)
        y = torch.einsum("btpn,btn->btp", h, self.to_c(x))  # contracts n: y is as wide as x
        z = self.back(torch.tanh(self.out_proj(y)))
        return x + z if self.residual else z


class Stack(nn.Module):
    def __init__(self, out: int, layers: int = 2, residual: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(6, 3, out, residual) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _region_lines(cm: gs.CompiledModule) -> list[str]:
    return [m.describe for m in cm.graph.modules() if hasattr(m, "scan") and hasattr(m, "describe")]


@pytest.mark.parametrize("out, residual, width", [(4, True, 4), (16, True, 6), (16, False, None)])
def test_region_goes_on_to_a_narrower_projection_only(out: int, residual: bool, width: int | None) -> None:
    """``width``: the channels of the region's output once extended (None: not extended)."""
    torch.manual_seed(0)
    model = Stack(out, residual=residual).double()
    x = torch.randn(2, 23, 6, dtype=torch.float64)
    cm = assert_same_grads(model, (x,), shard_size=5)
    lines = _region_lines(cm)
    assert len(lines) == 2, lines
    assert all(("past the contraction" in line) is (width is not None) for line in lines), lines
    if width is not None:  # narrowed: out_proj's (and tanh's) `out` channels; widened: the residual add's
        calls = [n for n in cm.graph.graph.nodes if n.op == "call_module" and str(n.target).startswith("adjoint_")]
        assert len(calls) == 2, calls
        for call in calls:  # the region's outputs are the getitems of its call
            widths = {u.meta["val"].shape[-1] for u in call.users}
            assert widths == {width}, (call.target, widths)
