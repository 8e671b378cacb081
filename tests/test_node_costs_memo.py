"""Speed-ups of the compile path that must not change a number: per-node FLOPs replayed once per
distinct signature (``node_cost`` with a memo), and the cost model's frozen collector (``older_objects_frozen``)."""

from __future__ import annotations

import gc

import torch
import torch.fx as fx

import gradshard as gs
import gradshard.analysis.node_costs as nc
from gradshard.cost.probe import older_objects_frozen
from gradshard.examples import factories as F

aten = torch.ops.aten


def _graph(a: torch.Tensor, b: torch.Tensor) -> fx.Graph:
    """``mm(x, x)``, ``mm(x, y)``, twice each, and a constant that differs only in its sign."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    x.meta["val"], y.meta["val"] = a, b
    outs = []
    for _ in range(2):
        for lhs, rhs in ((x, x), (x, y)):
            n = g.call_function(aten.mm.default, (lhs, rhs))
            n.meta["val"] = torch.empty(a.shape[0], b.shape[1], device="meta")
            outs.append(n)
    for c in (0.0, -0.0):
        n = g.call_function(aten.mul.Tensor, (x, c))
        n.meta["val"] = torch.empty_like(a, device="meta")
        outs.append(n)
    g.output(tuple(outs))
    return g


def test_memoised_costs_equal_replayed_costs_and_replay_each_signature_once(monkeypatch) -> None:
    a = torch.empty(5, 5, device="meta")
    nodes = list(_graph(a, torch.empty(5, 5, device="meta")).nodes)
    plain = [nc.node_cost(n) for n in nodes]
    replays = []
    real = nc._flops
    monkeypatch.setattr(nc, "_flops", lambda n: replays.append(n.name) or real(n))
    memo: dict = {}
    assert [nc.node_cost(n, memo) for n in nodes] == plain
    # x @ x (one input needing a gradient) and x @ y (two) are different signatures, and so are
    # the constants 0.0 and -0.0; the second of each pair of equal mm nodes is looked up
    assert len(replays) == 4, replays
    assert nc._flops_key(nodes[2]) != nc._flops_key(nodes[3])  # x @ x: one input; x @ y: two
    assert nc._flops_key(nodes[2]) == nc._flops_key(nodes[4])


def test_a_symbolic_size_is_replayed_not_keyed() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.empty(4, 6), symbolic_context=None)
    with mode:
        sym = mode.shape_env.create_unbacked_symint()
    g = fx.Graph()
    p = g.placeholder("x")
    p.meta["val"] = x
    n = g.call_function(aten.view.default, (p, [sym, 3]))
    assert nc._flops_key(n) is None


def test_scheduled_program_costs_are_unchanged_by_the_memo() -> None:
    """Every stage of a compiled program sums the same FLOPs as replaying every node."""
    model, inputs = F.llama(seq_len=24)
    cm = gs.compile(model, "none")
    cm(*inputs)
    gm = cm._last.gm
    costs = {n.name: nc.node_cost(n) for n in gm.graph.nodes}
    stages = [s for s in cm._last.program.stages if s.kind in ("forward", "autograd_backward")]
    assert stages
    for s in stages:
        want = sum((costs[n].fwd_flops if s.phase == "forward" else costs[n].bwd_flops) for n in s.nodes)
        assert s.flops == want, s.name


def test_older_objects_are_frozen_inside_and_a_callers_freeze_is_left_alone() -> None:
    # a frozen object can still die (another thread of the process may drop it), so the frozen count
    # may fall while it is read; it never rises without a freeze
    assert gc.get_freeze_count() == 0
    with older_objects_frozen():
        assert gc.get_freeze_count() > 0
        inner = gc.get_freeze_count()
        young = [[] for _ in range(1000)]  # tracked objects a second freeze would take too
        with older_objects_frozen():  # nested (validate_plan around gs.cost): nothing more
            assert gc.get_freeze_count() <= inner
        assert 0 < gc.get_freeze_count() <= inner
        del young
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with older_objects_frozen():
            pass
        assert 0 < gc.get_freeze_count() <= frozen  # the caller's freeze stays
    finally:
        gc.unfreeze()
