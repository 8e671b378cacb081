"""Heinsen's log-space scan (minGRU / minLSTM) becomes a linear_scan the adjoint plan shards.

The models are written the way the minGRU reference code writes them: ``-softplus`` gates,
``log_g`` values, ``cumsum`` + ``logcumsumexp``, and ``prev_hidden`` prepended in log space with
a zero-padded ``log_coeffs``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradshard as gs

from .helpers import assert_same_grads


def log_g(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, (F.relu(x) + 0.5).log(), -F.softplus(-x))


def heinsen_associative_scan_log(log_coeffs: torch.Tensor, log_values: torch.Tensor) -> torch.Tensor:
    a_star = log_coeffs.cumsum(dim=1)
    log_h0_plus_b_star = (log_values - a_star).logcumsumexp(dim=1)
    log_h = a_star + log_h0_plus_b_star
    return log_h.exp()


class MinGRU(nn.Module):
    def __init__(self, dim: int, hidden: int, learned_h0: bool) -> None:
        super().__init__()
        self.to_hidden_and_gate = nn.Linear(dim, hidden * 2, bias=False)
        self.to_out = nn.Linear(hidden, dim, bias=False)
        self.h0 = nn.Parameter(0.3 * torch.randn(1, 1, hidden)) if learned_h0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_len = x.shape[1]
        hidden, gate = self.to_hidden_and_gate(x).chunk(2, dim=-1)
        log_coeffs = -F.softplus(gate)
        log_values = -F.softplus(-gate) + log_g(hidden)
        if self.h0 is not None:
            prev_hidden = self.h0.exp().expand(x.shape[0], 1, -1)
            log_values = torch.cat((prev_hidden.log(), log_values), dim=1)
            log_coeffs = F.pad(log_coeffs, (0, 0, 1, 0))
        out = heinsen_associative_scan_log(log_coeffs, log_values)
        return self.to_out(out[:, -seq_len:])


class MinGRUStack(nn.Module):
    def __init__(self, dim: int = 5, hidden: int = 7, layers: int = 2, learned_h0: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MinGRU(dim, hidden, learned_h0) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(self.norm(x))
        return x


class LogSpaceReadout(nn.Module):
    """Uses ``log_h`` itself (not ``exp(log_h)``): left in log space, not rewritten."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_a, log_u = self.proj(x).chunk(2, dim=-1)
        a_star = F.logsigmoid(log_a).cumsum(1)
        return a_star + torch.logcumsumexp(log_u - a_star, 1)


def _x(batch: int, length: int, dim: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, length, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _written(cm: gs.CompiledModule) -> list:
    return [(r.kind, r.options.get("written_as")) for r in cm.regions if r.kind in ("linear_recurrence", "time_mixer")]


@pytest.mark.parametrize("learned_h0", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_adjoint_is_exact_and_finds_one_scan_per_layer(learned_h0, batch):
    torch.manual_seed(1)
    model = MinGRUStack(learned_h0=learned_h0).double()
    cm = assert_same_grads(model, (_x(batch, 13),), plan="adjoint", shard_size=4)
    assert _written(cm) == [("linear_recurrence", "logcumsumexp")] * 2
    notes = [n for r in cm.passes if r.name == "canonicalize_recurrences" for n in r.notes]
    assert sum("logcumsumexp" in n for n in notes) == 2
    assert all("initial state unfolded" in n for n in notes if "logcumsumexp" in n) == learned_h0


@pytest.mark.parametrize("plan,opts", [("truncated_adjoint", {"window": 5, "shard_size": 4}),
                                       ("seco", {"chunk_size": 4})])
def test_other_plans_stay_exact_on_the_rewritten_scan(plan, opts):
    torch.manual_seed(2)
    model = MinGRUStack(learned_h0=True).double()
    if plan == "truncated_adjoint":  # truncation changes the gradient: compare the forward only
        cm = gs.compile(model, plan=plan, **opts)
        x = _x(2, 11)
        assert torch.allclose(cm(x), model(x), rtol=1e-12, atol=0)
        assert _written(cm) == [("linear_recurrence", "logcumsumexp")] * 2
    else:
        assert_same_grads(model, (_x(2, 11),), plan=plan, **opts)


def test_a_model_captured_at_one_length_runs_at_another():
    torch.manual_seed(3)
    model = MinGRUStack(learned_h0=True).double()
    cm = gs.compile(model, plan="adjoint", shard_size=4)
    cm(_x(2, 9))
    ref = copy.deepcopy(model)
    x = _x(2, 23, seed=4)
    assert torch.allclose(cm(x), ref(x), rtol=1e-12, atol=0)
    assert_same_grads(model, (x,), plan="adjoint", reference=ref, shard_size=4)


def test_adjoint_keeps_far_less_than_autograd():
    torch.manual_seed(5)
    model = MinGRUStack(hidden=16, layers=2).double()
    x = _x(2, 64)

    def saved(run) -> int:
        def step(x: torch.Tensor) -> None:
            model.zero_grad(set_to_none=True)
            run(x).square().sum().backward()

        step(x)
        return gs.measure(step, x).saved_bytes

    eager, adjoint = saved(model), saved(gs.compile(model, plan="adjoint", shard_size=8))
    assert adjoint * 5 < eager, (adjoint, eager)


def test_log_h_used_in_log_space_is_left_alone_and_exact():
    torch.manual_seed(6)
    model = LogSpaceReadout().double()
    cm = gs.compile(model, plan="none")
    x = _x(2, 9, dim=4)
    assert torch.equal(cm(x), model(x))
    assert ("linear_recurrence", "logcumsumexp") not in _written(cm)
