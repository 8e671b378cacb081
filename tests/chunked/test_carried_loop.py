"""Carried loops under seco/spaco: a per-step loop whose update is not linear in one state runs
as captured, step by step, with its carried values checkpointed at chunk bounds (float64, odd
lengths, exact to 1e-10 against plain autograd)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradshard as gs
from gradshard.errors import GradshardError


class GatedTanhRNN(nn.Module):
    """``h = tanh(W h + x_t)`` with a learned initial state; returns the stacked states (time at
    dim 1) and a readout stacked at dim 0."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.W = nn.Linear(d, d)
        self.out = nn.Linear(d, 3)
        self.h0 = nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.h0.expand(x.shape[0], -1)
        hs, ys = [], []
        for t in range(x.shape[1]):
            h = torch.tanh(self.W(h) + x[:, t])
            hs.append(h)
            ys.append(self.out(h * x[:, t]))
        return torch.stack(hs, 1), torch.stack(ys, 0)


class PreUpdateReadout(nn.Module):
    """RWKV's WKV shape: the output reads the values carried *into* the step (num, den and a
    running max), then the update, skipped after the last output (as dead code is dropped from
    RWKV's captured graph): the last step is shorter than the others."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d)
        self.decay = nn.Parameter(-torch.rand(d))
        self.first = nn.Parameter(torch.rand(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = self.k(x), self.v(x)
        num = torch.zeros_like(k[:, 0])
        den = torch.zeros_like(k[:, 0])
        m = torch.zeros_like(k[:, 0]) - 1e30
        ys = []
        for t in range(x.shape[1]):
            kt = k[:, t]
            m_out = torch.maximum(m, kt + self.first)
            e1, e2 = torch.exp(m - m_out), torch.exp(kt + self.first - m_out)
            ys.append((e1 * num + e2 * v[:, t]) / (e1 * den + e2))
            if t == x.shape[1] - 1:
                break
            m_new = torch.maximum(m + self.decay, kt)
            e1, e2 = torch.exp(m + self.decay - m_new), torch.exp(kt - m_new)
            num, den, m = e1 * num + e2 * v[:, t], e1 * den + e2, m_new
        return torch.stack(ys, 1)


def _grads(model: nn.Module, x: torch.Tensor, fn) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    outs = fn(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o * torch.linspace(0.5, 1.5, o.numel(), dtype=o.dtype).reshape(o.shape)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [p.grad for p in model.parameters()] + [x.grad]


def _assert_exact(model: nn.Module, x: torch.Tensor, plan: str, **options) -> gs.CompiledModule:
    ref = copy.deepcopy(model)
    cm = gs.compile(model, plan=plan, **options)
    outs, grads = _grads(model, x, cm)
    ref_outs, ref_grads = _grads(ref, x, ref)
    for o, r in zip(outs, ref_outs):
        assert float((o - r).abs().max()) <= 1e-10 * float(r.abs().max())
    scale = max(float(g.abs().max()) for g in ref_grads)  # shift-invariant outputs: noise-level grads
    for g, r in zip(grads, ref_grads):
        assert g is not None and float((g - r).abs().max()) <= 1e-10 * scale
    return cm


def _x(T: int = 11, d: int = 4) -> torch.Tensor:
    return torch.randn(2, T, d, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_nonlinear_loop_with_stacked_states_and_readout(chunk: int) -> None:
    torch.manual_seed(0)
    cm = _assert_exact(GatedTanhRNN().double(), _x(), "seco", chunk_size=chunk)
    notes = [n for r in cm.passes if r.name == "roll_loops_carrying" for n in r.notes]
    assert any("carrying 1 value(s)" in n for n in notes), notes


def test_readout_of_the_carried_values_before_the_update() -> None:
    """The last step lacks its (dead) update; the loop is cut after each step's output."""
    torch.manual_seed(0)
    cm = _assert_exact(PreUpdateReadout().double(), _x(d=5), "seco", chunk_size=4)
    notes = [n for r in cm.passes if r.name == "roll_loops_carrying" for n in r.notes]
    assert any("carrying 3 value(s)" in n and "last step was completed" in n for n in notes), notes


def test_spaco_keeping_every_chunk_is_exact_and_a_sampled_backward_runs() -> None:
    torch.manual_seed(0)
    _assert_exact(PreUpdateReadout().double(), _x(d=5), "spaco", chunk_size=4, budget=100)
    model = PreUpdateReadout().double()
    cm = gs.compile(model, plan="spaco", chunk_size=3, budget=2, generator=torch.Generator().manual_seed(0))
    cm(_x(d=5)).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("plan, opts", [("adjoint", {"shard_size": 4}), ("truncated_adjoint", {"shard_size": 4, "window": 64})])
def test_adjoint_plans_regroup_the_max_driven_loop_exactly(plan: str, opts: dict) -> None:
    """The running max is a driver (it reads no other carried value) and num/den are linear
    given it: passes/recurrence_driven.py runs the max as a loop and num/den as one scan."""
    torch.manual_seed(0)
    cm = _assert_exact(PreUpdateReadout().double(), _x(d=5), plan, **opts)
    notes = [n for r in cm.passes if r.name == "roll_driven_loops" for n in r.notes]
    assert notes, [r.name for r in cm.passes]


class FinalStateRNN(GatedTanhRNN):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.h0.expand(x.shape[0], -1)
        hs = []
        for t in range(x.shape[1]):
            h = torch.tanh(self.W(h) + x[:, t])
            hs.append(h)
        return torch.stack(hs, 1), h


def test_final_value_read_after_the_loop_is_refused_naming_it() -> None:
    """No single step leaves a chunked region: the last step's value read after the loop is
    refused naming the loop's line, advising the plans that work (not seco)."""
    cm = gs.compile(FinalStateRNN().double(), plan="seco", chunk_size=4)
    with pytest.raises(GradshardError, match="after its last step") as info:
        cm(_x())
    assert "test_carried_loop.py" in str(info.value) and "plan='none'" in str(info.value)
