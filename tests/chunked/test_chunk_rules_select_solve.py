"""Chunk rules for triangular solves, top-k/sort, integer repeat_interleave along time and
stack: ``seco`` is exact (float64, rel err <= 1e-10) on small non-HF models with odd shapes,
and solves that read later steps are refused naming the node."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gradshard as gs
from chunk_testing import grads, rel_err
from gradshard.errors import GradshardError

TOL = 1e-10


class DeltaSolve(nn.Module):
    """A UT-transform block (DeltaNet's within-block solve) over the whole sequence:
    ``X = (I + tril(beta k k^T, -1))^-1 v`` by a lower unitriangular solve along time, read by
    causally masked scores."""

    def __init__(self, d: int = 6, n: int = 5, upper: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, n), nn.Linear(d, n), nn.Linear(d, n)
        self.b = nn.Linear(d, 1)
        self.o = nn.Linear(n, d)
        self.upper = upper

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        q, v = self.q(x), self.v(x)
        k = self.k(x)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)  # HF's l2norm
        beta = torch.sigmoid(self.b(x))
        upper = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(0)
        system = ((k * beta) @ k.transpose(-1, -2)).masked_fill(upper.T if self.upper else upper, 0.0)
        u = torch.linalg.solve_triangular(system, v * beta, upper=self.upper, unitriangular=True)
        scores = (q @ k.transpose(-1, -2)).masked_fill(upper.triu(1), 0.0)
        return self.o(scores @ u) + x


class StepSolve(nn.Module):
    """A small triangular system per time step (time only on a batch dim of the solve)."""

    def __init__(self, d: int = 6, m: int = 3) -> None:
        super().__init__()
        self.m = m
        self.a = nn.Linear(d, m * m)
        self.r = nn.Linear(d, m * 2)
        self.o = nn.Linear(m * 2, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = x.cumsum(1)  # a scan along time (time-axis evidence), carried across chunks
        a = self.a(h).view(B, T, self.m, self.m)
        rhs = self.r(h).view(B, T, self.m, 2)
        sol = torch.linalg.solve_triangular(a.tril(-1), rhs, upper=False, unitriangular=True)
        return self.o(sol.reshape(B, T, -1)) + x


class TopkRouter(nn.Module):
    """Tokens flattened over (batch, time), routed to the top-2 of 4 experts: ``topk`` over the
    expert dim, tokens copied per choice by ``repeat_interleave``, gathered expert weights,
    plus a ``stack`` of two time-carrying pieces."""

    def __init__(self, d: int = 6, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, experts)
        self.w = nn.Parameter(torch.randn(experts, d, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        h = x.cumsum(1)
        flat = h.reshape(-1, d)
        probs = torch.softmax(self.router(flat), dim=-1)
        top_w, top_i = torch.topk(probs, self.k, dim=-1)
        tokens = flat.repeat_interleave(self.k, dim=0)
        out = torch.bmm(self.w[top_i.reshape(-1)], tokens.unsqueeze(-1)).squeeze(-1)
        out = (out * top_w.reshape(-1, 1)).view(-1, self.k, d).sum(1).view(B, T, d)
        both = torch.stack([out, h.sin()], dim=2)
        return both.sum(2)


def _check(model: nn.Module, x: torch.Tensor, chunk: int) -> None:
    cm = gs.compile(model, plan="seco", chunk_size=chunk)
    out, ref = cm(x), model(x)
    assert float((out - ref).detach().abs().max()) <= 1e-12 * max(1.0, float(ref.abs().max()))
    cot = torch.randn_like(ref)
    wrt = [*model.parameters(), x]
    assert rel_err(grads(ref, wrt, cot), grads(out, wrt, cot)) <= TOL


@pytest.mark.parametrize("batch", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_lower_triangular_solve_along_time_is_exact(batch: int) -> None:
    torch.manual_seed(0)
    model = DeltaSolve().double()
    x = torch.randn(batch, 13, 6, dtype=torch.float64, requires_grad=True)
    _check(model, x, chunk=4)


def test_upper_triangular_solve_along_time_is_refused_naming_the_node() -> None:
    torch.manual_seed(0)
    model = DeltaSolve(upper=True).double()
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    with pytest.raises(GradshardError, match="linalg_solve_triangular"):
        gs.compile(model, plan="seco", chunk_size=4)(x)


def test_triangular_solve_per_step_is_local_and_exact() -> None:
    torch.manual_seed(1)
    model = StepSolve().double()
    x = torch.randn(3, 11, 6, dtype=torch.float64, requires_grad=True)
    _check(model, x, chunk=4)


def test_topk_router_repeat_interleave_and_stack_are_exact() -> None:
    torch.manual_seed(2)
    model = TopkRouter().double()
    x = torch.randn(3, 11, 6, dtype=torch.float64, requires_grad=True)
    _check(model, x, chunk=4)


def test_topk_along_time_is_refused() -> None:
    class TopkTime(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x.cumsum(1))
            vals, _ = torch.topk(h, 2, dim=1)  # the two largest steps: reads the future
            return h * vals.sum(1, keepdim=True)

    x = torch.randn(2, 9, 4, dtype=torch.float64)
    with pytest.raises(GradshardError):
        gs.compile(TopkTime().double(), plan="seco", chunk_size=4)(x)


@pytest.mark.parametrize("upper, reach", [(False, "all-past"), (True, "global")])
def test_time_analysis_of_a_solve_along_time(upper: bool, reach: str) -> None:
    """Forward substitution (lower) reads the past; back substitution (upper) the future."""
    from gradshard.analysis.locality import analyze_time_locality
    from gradshard.capture import capture

    model = DeltaSolve(upper=upper).double()
    cap = capture(model, (torch.randn(2, 9, 6, dtype=torch.float64),))
    tl = analyze_time_locality(cap.gm)
    solves = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.linalg_solve_triangular.default]
    assert len(solves) == 1
    assert str(tl[solves[0]].reach) == reach
