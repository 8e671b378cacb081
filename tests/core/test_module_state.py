"""The compiled module computes what the eager module would compute *now*: training mode,
rebound parameters, requires_grad changes and buffers updated in forward (issue 20)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import gradshard as gs
from gradshard.errors import CaptureError, GradshardError

from .helpers import loss_of

PLANS = {
    "none": {},
    "seco": {"chunk_size": 4},
    "spaco": {"chunk_size": 4, "budget": 3},
    "adjoint": {"shard_size": 4},
    "truncated_adjoint": {"window": 64, "shard_size": 4},
}


class Counter(nn.Module):
    """A step counter read by the output, and an EMA of the inputs (a whole-sequence mean that
    only the buffer sees: chunked plans split it per chunk), both updated in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 5)
        self.register_buffer("steps", torch.zeros((), dtype=torch.float64))
        self.register_buffer("ema", torch.zeros(5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean((0, 1)))
        return self.proj(x).cumsum(1) * self.steps


class Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 5)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(x)).cumsum(1)


def _x(T: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, T, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_buffers_updated_in_forward_match_eager(plan: str) -> None:
    torch.manual_seed(0)
    eager = Counter().double()
    mine = copy.deepcopy(eager)
    cm = gs.compile(mine, plan=plan, **PLANS[plan])
    for step in range(3):
        x = _x(seed=step)
        eager.zero_grad()
        mine.zero_grad()
        want = eager(x)
        got = cm(x)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        loss_of(want).backward()
        loss_of(got).backward()
        for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-10, msg=name)
    assert mine.steps.item() == eager.steps.item() == 3
    torch.testing.assert_close(mine.ema, eager.ema, rtol=0, atol=1e-14)


def test_whole_sequence_statistic_read_by_every_step_is_refused_by_seco() -> None:
    class Centered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(5, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x).cumsum(1) - x.mean((0, 1))

    with pytest.raises(GradshardError, match=r"(?s)test_module_state.py.*reduction over the whole sequence"):
        gs.compile(Centered().double(), plan="seco", chunk_size=4)(_x())


def test_batch_norm_running_statistics_match_eager() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv1d(4, 4, 3, padding=1), nn.BatchNorm1d(4)).double()
    mine = copy.deepcopy(eager)
    cm = gs.compile(mine, plan="none")
    for step in range(3):
        x = torch.randn(3, 4, 9, dtype=torch.float64)
        torch.testing.assert_close(cm(x), eager(x), rtol=1e-10, atol=1e-10)
    bn, ref = mine[1], eager[1]
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=0, atol=1e-14)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=0, atol=1e-14)
    assert bn.num_batches_tracked.item() == ref.num_batches_tracked.item() == 3
    assert "num_batches_tracked" in cm.explain()


def test_capture_leaves_buffers_untouched() -> None:
    model = Counter().double()
    gs.compile(model, plan="seco", chunk_size=4).compiled_for(_x())
    assert model.steps.item() == 0 and model.ema.abs().sum().item() == 0


def test_buffer_updated_through_a_view_is_refused() -> None:
    class Cache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("last", torch.zeros(2, 5, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last[:, :3] = x[:, -1, :3]
            return x.cumsum(1)

    with pytest.raises(CaptureError, match=r"buffer `last` is updated in place through a view") as err:
        gs.compile(Cache(), plan="none")(_x())
    assert "test_module_state.py" in str(err.value)


@pytest.mark.parametrize("plan", ["seco", "adjoint"])
def test_dropout_refusal_advice_eval_works(plan: str) -> None:
    model = Dropper().double()
    cm = gs.compile(model, plan=plan, **PLANS[plan])
    with pytest.raises(GradshardError, match=r"model\.eval\(\)"):
        cm(_x())
    model.eval()  # what the refusal advises
    torch.testing.assert_close(cm(_x()), model(_x()), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("plan", ["none"])
def test_eval_after_train_captures_again(plan: str) -> None:
    torch.manual_seed(0)
    model = Dropper().double()
    cm = gs.compile(model, plan=plan, **PLANS[plan])
    x = _x()
    cm(x)
    model.eval()
    torch.testing.assert_close(cm(x), model(x), rtol=1e-10, atol=1e-10)
    assert len(cm.specializations) == 2
    assert "training mode changed" in cm.explain()
    model.train()
    cm(x)
    assert len(cm.specializations) == 2  # the train-mode capture is reused


@pytest.mark.parametrize("plan", ["none", "adjoint"])
def test_rebound_parameter_is_used(plan: str) -> None:
    torch.manual_seed(0)
    model = Dropper().double().eval()
    cm = gs.compile(model, plan=plan, **PLANS[plan])
    x = _x()
    cm(x)
    model.proj.weight = nn.Parameter(torch.randn(5, 5, dtype=torch.float64))
    out = cm(x)
    torch.testing.assert_close(out, model(x), rtol=1e-10, atol=1e-10)
    loss_of(out).backward()
    assert model.proj.weight.grad is not None
    assert len(cm.specializations) == 1  # same kind of tensor: no new capture


def test_replaced_submodule_is_used() -> None:
    model = Dropper().double().eval()
    cm = gs.compile(model, plan="none")
    x = _x()
    cm(x)
    model.proj = nn.Linear(5, 5).double().eval()  # same names, shapes, mode: no new capture
    torch.testing.assert_close(cm(x), model(x), rtol=1e-10, atol=1e-10)
    assert len(cm.specializations) == 1


def test_frozen_parameter_captures_again_and_gets_no_grad() -> None:
    model = Dropper().double().eval()
    cm = gs.compile(model, plan="none")
    x = _x()
    cm(x)
    model.proj.weight.requires_grad_(False)
    loss_of(cm(x)).backward()
    assert model.proj.weight.grad is None and model.proj.bias.grad is not None
    assert len(cm.specializations) == 2
    assert "proj.weight" in cm.explain()


def test_dtype_move_captures_again() -> None:
    model = Dropper().eval()
    cm = gs.compile(model, plan="none")
    cm(_x().float())
    model.double()
    torch.testing.assert_close(cm(_x()), model(_x()), rtol=1e-10, atol=1e-10)


def test_cache_is_bounded() -> None:
    model = Dropper().double().eval()
    cm = gs.compile(model, plan="none", cache_size=2)
    for T in (5, 6, 7, 8):
        cm(_x(T))
    assert len(cm.specializations) == 2
    # lengths after the first are served from its graph (extras["seq_len"]) or captured
    assert [e.extras.get("seq_len", e.captured.example_inputs[-1].shape[1]) for e in cm.specializations] == [7, 8]


@pytest.mark.parametrize("kwargs, match", [
    ({"frontend": "jit"}, "unknown frontend"),
    ({"cache_size": 0}, "cache_size"),
    ({"time_axis": (0,)}, "time_axis"),
    ({"backend": "cuda"}, "backend"),
])
def test_compile_arguments_validated_at_compile(kwargs: dict, match: str) -> None:
    with pytest.raises(GradshardError, match=match):
        gs.compile(Dropper(), plan="none", **kwargs)


class _ModeScaled(nn.Module):
    """An SSM whose output scale depends on the training flag."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.inner(ids)
        return out * 2.0 if self.training else out * 3.0


@pytest.mark.parametrize("plan", ["seco", "adjoint"])
def test_a_new_length_after_eval_is_not_served_from_the_train_mode_graph(plan: str) -> None:
    """A specialiser serves a new length only from an entry compiled in the modules' current
    state: after ``.eval()`` the train-mode program must not run (it did under adjoint)."""
    from gradshard.examples import factories

    inner, (ids,) = factories.ssm(seq_len=400, batch=1, d_model=16, n_layers=1, dtype=torch.float64)
    model = _ModeScaled(inner)
    cm = gs.compile(model, plan=plan, **{"seco": {"chunk_size": 64}, "adjoint": {"shard_size": 64}}[plan])
    cm(ids[:, :300])
    model.eval()
    with torch.no_grad():
        got = cm(ids)
        want = model(ids)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
