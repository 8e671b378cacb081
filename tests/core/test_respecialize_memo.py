"""The memo of re-specialisation's shape verification (:mod:`gradshard.passes.respecialize_memo`):
a graph propagated before node for node replays the stored outcome; anything that changes the
outcome (length, batch, a graph changed in place) misses; results stay independent copies."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.fx as fx

from gradshard.passes.respecialize import DimFact, RespecializeError, respecialize
from gradshard.passes.respecialize_memo import MEMO, clear_memo, fresh_memo

aten = torch.ops.aten
C = 20  # features: the weight is above the size keyed by value


def _graph(prefix: str = "") -> tuple[fx.GraphModule, dict]:
    """``x [B=2, T=8, C] * w -> view [B*T, C] -> sum(-1)`` with its facts; ``prefix`` renames
    every node (another layer's copy of the same region)."""
    g = fx.Graph()
    x = g.placeholder(f"{prefix}x")
    x.meta["val"] = torch.empty(2, 8, C, dtype=torch.float64)
    w = g.get_attr(f"{prefix}weight")
    w.meta["val"] = torch.empty(C, dtype=torch.float64)
    m = g.call_function(aten.mul.Tensor, (x, w))
    m.meta["val"] = torch.empty(2, 8, C, dtype=torch.float64)
    v = g.call_function(aten.view.default, (m, [16, C]))
    v.meta["val"] = torch.empty(16, C, dtype=torch.float64)
    s = g.call_function(aten.sum.dim_IntList, (v, [1]))
    s.meta["val"] = torch.empty(16, dtype=torch.float64)
    g.output(s)
    root = torch.nn.Module()
    root.register_parameter(f"{prefix}weight", torch.nn.Parameter(torch.randn(C, dtype=torch.float64)))
    gm = fx.GraphModule(root, g)
    bt, t = DimFact("scale", 2, batch=True), DimFact("shift", 0)
    facts = {x.name: (DimFact("fixed", 2, batch=True), t, None), w.name: (None,),
             m.name: (DimFact("fixed", 2, batch=True), t, None), v.name: (bt, None), s.name: (bt,)}
    return gm, facts


def _shapes(gm: fx.GraphModule) -> list:
    return [tuple(n.meta["val"].shape) for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]


@pytest.fixture(autouse=True)
def _empty_memo():
    clear_memo()
    yield
    clear_memo()


def test_a_repeat_hits_and_returns_an_independent_correct_copy() -> None:
    gm, facts = _graph()
    first = respecialize(gm, facts, 8, 10)
    assert (MEMO.hits, MEMO.misses) == (0, 1)
    second = respecialize(gm, facts, 8, 10)
    assert (MEMO.hits, MEMO.misses) == (1, 1)
    assert second is not first and second.graph is not first.graph
    assert _shapes(second) == _shapes(first) == [(2, 10, C), (C,), (2, 10, C), (20, C), (20,)]
    x = torch.randn(2, 10, C, dtype=torch.float64)
    torch.testing.assert_close(second(x), (x * gm.weight).reshape(20, C).sum(1), rtol=0, atol=0)
    # changing one copy leaves the other (and the next hit) alone
    next(n for n in first.graph.nodes if n.op == "output").args = (next(iter(first.graph.nodes)),)
    first.recompile()
    assert second(x).shape == (20,)
    assert respecialize(gm, facts, 8, 10)(x).shape == (20,)
    assert respecialize(gm, facts, 8, 10, keep_values=False)(x).shape == (20,)
    assert MEMO.hits == 3


def test_another_length_or_batch_misses_and_gets_its_own_shapes() -> None:
    gm, facts = _graph()
    respecialize(gm, facts, 8, 10)
    assert _shapes(respecialize(gm, facts, 8, 12)) == [(2, 12, C), (C,), (2, 12, C), (24, C), (24,)]
    assert _shapes(respecialize(gm, facts, 8, 10, batch=(2, 3))) == [(3, 10, C), (C,), (3, 10, C), (30, C), (30,)]
    assert (MEMO.hits, MEMO.misses) == (0, 3)


def test_the_same_region_under_other_names_hits_with_its_own_parameters() -> None:
    gm, facts = _graph()
    other, other_facts = _graph("layer1_")
    respecialize(gm, facts, 8, 10)
    out = respecialize(other, other_facts, 8, 10)
    assert MEMO.hits == 1
    assert [n.name for n in out.graph.nodes] == [n.name for n in other.graph.nodes]
    x = torch.randn(2, 10, C, dtype=torch.float64)
    torch.testing.assert_close(out(x), (x * other.layer1_weight).reshape(20, C).sum(1), rtol=0, atol=0)


def test_a_graph_changed_in_place_misses() -> None:
    gm, facts = _graph()
    respecialize(gm, facts, 8, 10)
    s = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList][0]
    s.args = (s.args[0], [0])  # now sums over rows: the output is (C,), no longer time-carrying
    s.meta["val"] = torch.empty(C, dtype=torch.float64)
    facts = {**facts, s.name: (None,)}
    gm.recompile()
    assert _shapes(respecialize(gm, facts, 8, 10))[-1] == (C,)
    assert (MEMO.hits, MEMO.misses) == (0, 2)


def test_a_refusal_is_replayed() -> None:
    gm, facts = _graph()
    v = [n for n in gm.graph.nodes if n.target is aten.view.default][0]
    facts = {**facts, v.name: (None, None)}  # claims the view keeps its size: wrong at another T
    with pytest.raises(RespecializeError) as first:
        respecialize(gm, facts, 8, 10)
    with pytest.raises(RespecializeError) as again:
        respecialize(gm, facts, 8, 10)
    assert str(again.value) == str(first.value) and MEMO.hits == 1


def test_the_memo_is_bounded_and_holds_no_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MEMO, "max_entries", 2)
    gm, facts = _graph()
    for T in (9, 10, 11, 12):
        respecialize(gm, facts, 8, T)
    assert len(MEMO) == 2
    ref = weakref.ref(gm)
    del gm
    gc.collect()
    assert ref() is None


def test_a_graph_with_a_call_module_is_not_memoized() -> None:
    gm, facts = _graph()
    gm.add_submodule("act", torch.nn.Tanh())
    s = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList][0]
    with gm.graph.inserting_after(s):
        a = gm.graph.call_module("act", (s,))
    a.meta["val"] = torch.empty(16, dtype=torch.float64)
    s.replace_all_uses_with(a, delete_user_cb=lambda u: u is not a)
    gm.recompile()
    facts = {**facts, a.name: facts[s.name]}
    respecialize(gm, facts, 8, 10)
    respecialize(gm, facts, 8, 10)
    assert (MEMO.hits, len(MEMO)) == (0, 0)


def test_fresh_memo_starts_empty_and_puts_the_entries_back() -> None:
    """The cost model prices a fresh process's compile: inside ``fresh_memo`` nothing propagated
    before hits, and what was there is back afterwards."""
    gm, facts = _graph()
    respecialize(gm, facts, 8, 10)
    with fresh_memo():
        assert len(MEMO) == 0
        respecialize(gm, facts, 8, 10)
        respecialize(gm, facts, 8, 12)
        assert len(MEMO) == 2 and MEMO.misses == 3
    assert len(MEMO) == 1
    respecialize(gm, facts, 8, 10)
    assert MEMO.hits == 1
