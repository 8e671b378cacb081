"""Dims rules for a buffer filled piecewise along a (chunk, d) axis, and a loop that carries a
running maximum beside its state: exact under the chunked plans (a carried loop), refused by the
adjoint plans naming the max (small non-HF models, float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradshard as gs
from gradshard.analysis.locality import analyze_time_locality
from gradshard.capture.trace import capture


class ChunkStates(nn.Module):
    """Per-chunk states written into ``states[:, c*d:(c+1)*d]``, read back as ``(B, nc, d, dv)``
    (the layout of xLSTM's chunkwise kernel)."""

    def __init__(self, d: int = 4, dv: int = 6, cs: int = 5, dm: int = 7) -> None:
        super().__init__()
        self.d, self.cs = d, cs
        self.q = nn.Linear(dm, d, bias=False)
        self.k = nn.Linear(dm, d, bias=False)
        self.v = nn.Linear(dm, dv, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        d, cs = self.d, self.cs
        nc = T // cs
        q = self.q(x) * torch.sigmoid(x[..., :1].cumsum(1))
        k, v = self.k(x), self.v(x)
        states = x.new_zeros(B, (nc + 1) * d, v.shape[-1])
        C = x.new_zeros(B, d, v.shape[-1])
        for c in range(nc):
            states[:, c * d:(c + 1) * d] = C
            C = C + k[:, c * cs:(c + 1) * cs].transpose(1, 2) @ v[:, c * cs:(c + 1) * cs]
        states[:, nc * d:] = C
        Cs = states[:, :-d].view(B, nc, d, -1)
        return (q.view(B, nc, cs, d) @ Cs).reshape(B, T, -1)


def test_piecewise_state_buffer_does_not_tie_time_to_a_weight() -> None:
    """Splitting the buffer's (chunk, d) axis must not give the chunk index and d one label
    (which tied time to the q projection's output dim through the matmul)."""
    torch.manual_seed(0)
    x = torch.randn(3, 15, 7, dtype=torch.float64)
    cap = capture(ChunkStates().double(), (x,))
    tl = analyze_time_locality(cap.gm)
    dims = {str(ph.meta.get("gs_input_name")): tl[ph].time_dims for ph in cap.gm.graph.find_nodes(op="placeholder")}
    assert dims == {"q.weight": (), "k.weight": (), "v.weight": (), "input0": (1,)}


class StabilisedSum(nn.Module):
    """A log-sum-exp weighted running mean kept as (num, den, running max) per step."""

    def __init__(self, dm: int = 5) -> None:
        super().__init__()
        self.k = nn.Linear(dm, dm)
        self.w = nn.Parameter(-torch.rand(dm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.k(x)
        num = torch.zeros_like(x[:, 0])
        den = torch.zeros_like(x[:, 0])
        m = torch.zeros_like(x[:, 0]) - 1e30
        ys = []
        for t in range(x.shape[1]):
            m_new = torch.maximum(m + self.w, k[:, t])
            e1, e2 = torch.exp(m + self.w - m_new), torch.exp(k[:, t] - m_new)
            num, den, m = e1 * num + e2 * x[:, t], e1 * den + e2, m_new
            ys.append(num / den)
        return torch.stack(ys, 1)


def test_loop_carrying_a_running_max_is_exact_under_adjoint() -> None:
    """The max drives the loop (it reads no other carried value) and num/den are linear given
    it: the adjoint plan runs the max as a loop and num/den as one scan."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 5, dtype=torch.float64, requires_grad=True)
    model = StabilisedSum().double()
    ref = StabilisedSum().double()
    ref.load_state_dict(model.state_dict())
    cm = gs.compile(model, plan="adjoint", shard_size=4)
    x_ref = x.detach().clone().requires_grad_()
    w = torch.linspace(0.5, 1.5, 2 * 9 * 5, dtype=torch.float64).reshape(2, 9, 5)
    (cm(x) * w).sum().backward()
    (ref(x_ref) * w).sum().backward()
    for got, want in [(x.grad, x_ref.grad), *[(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]]:
        assert float((got - want).abs().max()) <= 1e-10 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("plan, opts", [("seco", {"chunk_size": 4}), ("spaco", {"chunk_size": 4, "budget": 100})])
def test_loop_carrying_a_running_max_is_exact_under_the_chunked_plans(plan: str, opts: dict) -> None:
    """Rolled into a carried loop: the chunks carry (num, den, running max) across their bounds."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 5, dtype=torch.float64, requires_grad=True)
    model = StabilisedSum().double()
    ref = StabilisedSum().double()
    ref.load_state_dict(model.state_dict())
    cm = gs.compile(model, plan=plan, **opts)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = cm(x), ref(x_ref)
    w = torch.linspace(0.5, 1.5, y.numel(), dtype=y.dtype).reshape(y.shape)
    (y * w).sum().backward()
    (y_ref * w).sum().backward()
    assert float((y - y_ref).detach().abs().max()) <= 1e-12
    # the output is invariant to a shift of k, so k's bias gradient is rounding noise: compare
    # every gradient against the largest one
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    for p, q in [*zip(model.parameters(), ref.parameters()), (x, x_ref)]:
        assert float((p.grad - q.grad).abs().max()) <= 1e-12 * scale
    notes = [n for r in cm.passes if r.name == "roll_loops_carrying" for n in r.notes]
    assert any("carrying 3 value(s)" in n for n in notes), notes
