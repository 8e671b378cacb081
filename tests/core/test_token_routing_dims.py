"""Token routing (mixture-of-experts layers) flattens ``(batch, time)`` into one row dim and
back; the dims rules must keep batch and time apart through it.

The route: ``x.view(-1, D)`` -> router ``topk`` -> ``repeat_interleave(k, dim=0)`` (one row
per chosen expert) -> expert weights gathered by index (``W[idx]``) -> ``bmm`` -> scaled by
the top-k weights -> ``view(-1, k, D).sum(1)`` -> ``reshape(B, T, D)``. Before the rules for
``topk``, integer ``repeat_interleave``, index factors and factor-keeping reductions, time was
merged with the batch dim here and the recurrence before the layer was not recognised.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import gradshard as gs
from gradshard.analysis.locality import analyze_time_locality
from gradshard.capture import capture
from gradshard.errors import GradshardError

B, T, D, E, K = 3, 11, 5, 4, 2


class LoopScanWithRouting(torch.nn.Module):
    """A per-step linear recurrence (an unrolled Python loop) followed by a top-k routed layer."""

    def __init__(self, d: int = D, experts: int = E, k: int = K) -> None:
        super().__init__()
        self.k = k
        self.a = torch.nn.Linear(d, d)
        self.u = torch.nn.Linear(d, d)
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(experts, d, d) * 0.4)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, d = x.shape
        a, u = torch.sigmoid(self.a(x)), self.u(x)
        h = x.new_zeros(batch, d)
        hs = []
        for t in range(steps):
            h = a[:, t] * h + u[:, t]
            hs.append(h)
        y = torch.stack(hs, 1)
        rows = y.view(-1, d)
        weights, index = torch.topk(torch.softmax(self.router(rows), dim=-1), self.k, dim=-1)
        copies = rows.repeat_interleave(self.k, dim=0)
        z = torch.bmm(self.experts[index.reshape(-1)], copies.unsqueeze(-1)).squeeze(-1)
        z = z * weights.reshape(-1, 1)
        routed = z.view(-1, self.k, d).sum(dim=1).reshape(batch, steps, d)
        return self.out(y + routed)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return LoopScanWithRouting().double()


def test_routing_keeps_batch_and_time_apart() -> None:
    x = torch.randn(B, T, D, dtype=torch.float64)
    cap = capture(_model(), (x,))
    tl = analyze_time_locality(cap.gm, example_inputs=cap.example_inputs)
    ph = list(cap.gm.graph.find_nodes(op="placeholder"))[-1]
    assert tl.time_inputs[ph.name] == 1 and tl.seq_len == T
    b, t = tl.dims.input_labels[ph.name][:2]
    assert tl.dims.canon(b) != tl.dims.canon(t)
    out = next(iter(cap.gm.graph.find_nodes(op="output"))).args[0][0]
    assert tl[out].time_dims == (1,) and tl[out].reach.is_causal
    nodes = {n.target: n for n in cap.gm.graph.nodes if n.op == "call_function"}
    rep = nodes[torch.ops.aten.repeat_interleave.self_int]
    assert tl[rep].time_dims == (0,) and tl[rep].reach.is_causal  # rows (B*T*k) still carry time
    topk = nodes[torch.ops.aten.topk.default]
    assert tl[topk].reach.is_causal  # a choice among experts, per token


@pytest.mark.parametrize("plan, options", [
    ("seco", {"chunk_size": 4}),
    ("adjoint", {"shard_size": 4}),
    ("truncated_adjoint", {"window": 1000, "shard_size": 4}),
])
def test_routed_layer_after_a_loop_scan_is_exact(plan: str, options: dict) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    x = torch.randn(B, T, D, dtype=torch.float64)
    w = torch.linspace(0.5, 1.5, B * T * D, dtype=torch.float64).reshape(B, T, D)
    cm = gs.compile(model, plan=plan, **options)
    got = cm(x)
    want = ref(x)
    (got * w).sum().backward()
    (want * w).sum().backward()
    assert float((got - want).detach().abs().max() / want.detach().abs().max()) <= 1e-10
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        err = float((q.grad - p.grad).abs().max() / p.grad.abs().max())
        assert err <= 1e-10, (plan, name, err)
    if plan != "seco":
        assert any(r.kind == "linear_recurrence" for r in cm.regions)


class TopkAlongTime(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.topk(x.cumsum(1), 3, dim=1).values


class SortFeatures(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, order = torch.sort(x.cumsum(1), dim=-1)
        return values * order


def test_topk_along_time_reads_every_step_and_chunking_refuses() -> None:
    x = torch.randn(2, 7, 4, dtype=torch.float64)
    cap = capture(TopkAlongTime(), (x,))
    tl = analyze_time_locality(cap.gm, example_inputs=cap.example_inputs)
    out = next(iter(cap.gm.graph.find_nodes(op="output"))).args[0][0]
    assert tl[out].time_dims == () and tl[out].reach.hi == math.inf
    with pytest.raises(GradshardError, match="topk"):
        gs.compile(TopkAlongTime(), plan="seco", chunk_size=3)(x)


def test_sort_along_features_keeps_time() -> None:
    x = torch.randn(2, 7, 4, dtype=torch.float64)
    cap = capture(SortFeatures(), (x,))
    tl = analyze_time_locality(cap.gm, example_inputs=cap.example_inputs)
    sort = next(n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.sort.default)
    assert tl[sort].time_dims == (1,) and tl[sort].local.is_pointwise
    out = next(iter(cap.gm.graph.find_nodes(op="output"))).args[0][0]
    assert tl[out].time_dims == (1,) and tl[out].reach.is_causal
