"""Loops that carry linear states beside a driver (``passes/recurrence_driven.py``) under the adjoint plans.

The models write their step loops the way ``transformers`` writes RWKV's WKV: a running
maximum ``m`` stabilises states kept as ``num * exp(-m)``. The adjoint plans split such a loop
into the maximum (run step by step) and one packed scan of the states, and are exact; a loop
whose other values are not linear in themselves is refused naming the op, with advice that
names only plans that run it (``seco``, ``spaco``, ``none``, ``partial_update``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradshard.errors import GradshardError
from gradshard.passes import loop_driven_emit

from .helpers import assert_same_grads

D = 6


def wkv(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``transformers``' ``rwkv_linear_attention_cpu`` in the key's dtype (no float32 island)."""
    output = torch.zeros_like(key)
    num_state = torch.zeros_like(key[:, 0])
    den_state = torch.zeros_like(key[:, 0])
    max_state = torch.zeros_like(key[:, 0]) - 1e38
    time_decay = -torch.exp(time_decay)
    for t in range(key.shape[1]):
        current_key, current_value = key[:, t], value[:, t]
        max_for_output = torch.maximum(max_state, current_key + time_first)
        e1 = torch.exp(max_state - max_for_output)
        e2 = torch.exp(current_key + time_first - max_for_output)
        output[:, t] = (e1 * num_state + e2 * current_value) / (e1 * den_state + e2)
        max_for_state = torch.maximum(max_state + time_decay, current_key)
        e1 = torch.exp(max_state + time_decay - max_for_state)
        e2 = torch.exp(current_key - max_for_state)
        num_state = e1 * num_state + e2 * current_value
        den_state = e1 * den_state + e2
        max_state = max_for_state
    return output


def squashed(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A max-stabilised loop whose state update is not linear (``tanh`` of the update)."""
    h = torch.zeros_like(key[:, 0])
    m = torch.zeros_like(key[:, 0]) - 1e38
    ys = []
    for t in range(key.shape[1]):
        m_new = torch.maximum(m + time_decay, key[:, t])
        h = torch.tanh(torch.exp(m + time_decay - m_new) * h + torch.exp(key[:, t] - m_new) * value[:, t])
        m = m_new
        ys.append(h * time_first)
    return torch.stack(ys, 1)


def two_states(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Two linear states and no driver: ``p_t = a p_{t-1} + x_t``, ``q_t = b q_{t-1} + x_t^2``."""
    p = torch.zeros_like(x[:, 0])
    q = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        p = a * p + x[:, t]
        q = b * q + x[:, t] * x[:, t]
        ys.append(p * q)
    return torch.stack(ys, 1)


class Layer(nn.Module):
    def __init__(self, kind: str, scale: float = 1.0) -> None:
        super().__init__()
        self.kind = kind
        self.key = nn.Linear(D, D)
        self.value = nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        with torch.no_grad():
            self.key.weight.mul_(scale)
        self.time_decay = nn.Parameter(torch.linspace(-1.5, 0.5, D))
        self.time_first = nn.Parameter(torch.linspace(-0.3, 0.4, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = self.key(x), self.value(x)
        if self.kind == "wkv":
            y = wkv(self.time_decay, self.time_first, k, v)
        elif self.kind == "squashed":
            y = squashed(self.time_decay, self.time_first, k, v)
        else:
            y = two_states(torch.sigmoid(self.time_decay), torch.sigmoid(self.time_first), torch.tanh(k))
        return x + self.out(y)


class Stack(nn.Module):
    def __init__(self, kind: str, scale: float = 1.0, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(kind, scale) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _model(kind: str, scale: float = 1.0, layers: int = 1) -> Stack:
    torch.manual_seed(0)
    return Stack(kind, scale, layers).double()


def _x(T: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


_TRUNCATED = {"window": 1000, "shard_size": 8}  # window >= T: exact


@pytest.mark.parametrize("plan, options, T", [
    ("adjoint", {"shard_size": 8}, 37),
    # 150 > 2 * 67: compiled at the adjoint's 67-step probe, then re-specialised to 150 steps
    pytest.param("adjoint", {"shard_size": 8}, 150, marks=pytest.mark.slow),
    pytest.param("truncated_adjoint", _TRUNCATED, 37, marks=pytest.mark.slow),
    pytest.param("truncated_adjoint", _TRUNCATED, 150, marks=pytest.mark.slow),
], ids=["adjoint-37", "adjoint-150", "truncated-37", "truncated-150"])
def test_wkv_is_exact(plan: str, options: dict, T: int) -> None:
    """Two layers: the second region's gradient flows through the first one's."""
    cm = assert_same_grads(_model("wkv", layers=2), (_x(T),), plan=plan, **options)
    notes = [n for r in cm.passes if r.name == "roll_driven_loops" for n in r.notes]
    assert len(notes) == 2 and all("packed into one scan" in n and "checked against the unrolled loop" in n
                                   for n in notes), notes
    assert sum(r.kind == "linear_recurrence" for r in cm.regions) == 2


def test_wkv_with_large_keys_does_not_overflow() -> None:
    """Keys near +-1000: exp(k) overflows float64 (a plain exp-space scan of num, den would give
    inf / inf); the max-shifted scan does not, like the model's own loop."""
    model, x = _model("wkv", scale=300.0), _x(21, scale=3.0)
    with torch.no_grad():
        keys = [layer.key(x) for layer in model.layers[:1]]
    assert float(keys[0].max()) > 710 and not torch.isfinite(torch.exp(keys[0])).all()
    assert_same_grads(model, (x,), plan="adjoint", shard_size=8)


def test_two_linear_states_without_a_driver_share_one_scan() -> None:
    cm = assert_same_grads(_model("two"), (_x(21),), plan="adjoint", shard_size=8)
    notes = [n for r in cm.passes if r.name == "roll_driven_loops" for n in r.notes]
    assert notes and all("driver(s) none" in n for n in notes), notes


def test_nonlinear_state_beside_a_running_max_is_refused_naming_the_op() -> None:
    with pytest.raises(GradshardError, match="running maximum") as info:
        assert_same_grads(_model("squashed"), (_x(21),), plan="adjoint", shard_size=8)
    text = str(info.value)
    assert "node `tanh" in text and "test_driven_loops.py" in text and "is not linear" in text
    assert "plan='seco'" in text and "plan='spaco'" in text and "plan='adjoint'" not in text
    assert_same_grads(_model("squashed"), (_x(21),), plan="seco", chunk_size=8)  # the advice holds


def test_numeric_check_catches_a_wrong_rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rolled loop is compared with the unrolled one on random inputs: a rewrite that scales
    the scanned inputs by 2 is an internal error, never a silently wrong model."""
    layout = loop_driven_emit._scan_layout

    def doubled(states, pack):
        fix = layout(states, pack)
        return lambda g, outs: [a if i == 0 else g.call_function(torch.ops.aten.mul.Tensor, (a, 2.0))
                                for i, a in enumerate(fix(g, outs))]

    monkeypatch.setattr(loop_driven_emit, "_scan_layout", doubled)
    with pytest.raises(GradshardError, match="internal check failed"):
        assert_same_grads(_model("wkv"), (_x(21),), plan="adjoint", shard_size=8)
