"""Property test (issue 20): random models (two written here, and the project's model zoo:
the example SSM, Llama and hybrid), random module-state changes between calls and random bad
inputs give the same result as eager, or a ``GradshardError``; nothing else."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradshard as gs
from gradshard.errors import GradshardError
from gradshard.examples import factories

from .helpers import loss_of


class Scan(nn.Module):
    """Dropout, a step counter read by the output, a scan over time."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return self.drop(self.proj(x)).cumsum(1) * (1 + 0.1 * self.steps)


class NormConv(nn.Module):
    """BatchNorm over channels (running statistics updated in forward) and a causal conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=2)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.conv(x.transpose(1, 2))[..., : x.shape[1]])
        return y.transpose(1, 2).cumsum(1)


def _zoo(name: str, **sizes: int):
    """A tiny float64 model of the project's zoo (``gradshard.examples.factories``), token ids in."""
    return lambda: getattr(factories, name)(dtype=torch.float64, **sizes)[0]


MODELS = {"scan": Scan, "normconv": NormConv, "zoo_ssm": _zoo("ssm", d_model=16, n_layers=1),
          "zoo_llama": _zoo("llama", d_model=16, n_layers=1), "zoo_hybrid": _zoo("hybrid", d_model=16)}
PLANS = {"none": {}, "seco": {"chunk_size": 3}, "adjoint": {"shard_size": 3}}
CHANGES = ("eval", "train", "rebind", "freeze", "nothing")
INPUTS = ("good", "nan", "short", "one_step", "wrong_rank", "int_dtype")


def _input(kind: str, T: int, model: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(T)
    if model.startswith("zoo_"):  # token ids: a NaN cannot occur, bools or floats where ints belong can
        x = torch.randint(0, 256, (2, T), generator=g)
        if kind == "int_dtype":
            return x.bool() if T % 2 else x.double()
        return x[0] if kind == "wrong_rank" else x[:, : max(2, T // 2)] if kind == "short" else (
            x[:, :1] if kind == "one_step" else x)
    x = torch.randn(2, T, 4, dtype=torch.float64, generator=g)
    if kind == "nan":
        x[0, T // 2, 1] = float("nan")
    elif kind == "short":
        x = x[:, : max(2, T // 2)]
    elif kind == "one_step":
        x = x[:, :1]
    elif kind == "wrong_rank":
        x = x[0]
    elif kind == "int_dtype":
        x = x.long()
    return x


def _change(kind: str, models: tuple[nn.Module, nn.Module]) -> None:
    for m in models:
        if kind == "eval":
            m.eval()
        elif kind == "train":
            m.train()
        elif kind == "freeze":
            next(m.parameters()).requires_grad_(False)
    if kind == "rebind":
        first = next(models[0].named_parameters())[0]
        owner_path, _, attr = first.rpartition(".")
        new = torch.randn_like(models[0].get_parameter(first))
        for m in models:
            owner = m.get_submodule(owner_path) if owner_path else m
            setattr(owner, attr, nn.Parameter(new.clone()))


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-9, atol=1e-9)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(sorted(MODELS)), plan=st.sampled_from(sorted(PLANS)),
       T=st.integers(5, 11), steps=st.lists(st.tuples(st.sampled_from(CHANGES), st.sampled_from(INPUTS)),
                                          min_size=1, max_size=3))
def test_same_as_eager_or_gradshard_error(model: str, plan: str, T: int, steps: list[tuple[str, str]]) -> None:
    torch.manual_seed(0)
    eager = MODELS[model]().double()
    mine = copy.deepcopy(eager)
    cm = gs.compile(mine, plan=plan, **PLANS[plan])
    for change, kind in [("nothing", "good"), *steps]:
        _change(change, (eager, mine))
        x = _input(kind, T, model)
        torch.manual_seed(1)
        before = copy.deepcopy(eager.state_dict())
        try:
            want = eager(x)
        except Exception as eager_exc:  # noqa: BLE001 - eager rejects the input: so must gradshard,
            # with a GradshardError or eager's own exception. A failed eager call may have updated
            # a buffer before it failed; gradshard's updates land only after a whole call.
            eager.load_state_dict(before)
            with pytest.raises((GradshardError, type(eager_exc))):
                torch.manual_seed(1)
                cm(x)
            continue
        torch.manual_seed(1)
        try:
            got = cm(x)
        except GradshardError as exc:  # a refusal must name a node (and its line) or the input
            assert "node `" in str(exc) or "input" in str(exc) or "plan" in str(exc), str(exc)
            return
        _same(got, want)
        eager.zero_grad()
        mine.zero_grad()
        loss_of(want.nan_to_num()).backward()
        loss_of(got.nan_to_num()).backward()
        for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
            if p.grad is None:
                assert q.grad is None or not q.grad.any(), name
            else:
                _same(q.grad, p.grad)
        for (name, b), c in zip(eager.named_buffers(), mine.buffers()):
            _same(c, b)
