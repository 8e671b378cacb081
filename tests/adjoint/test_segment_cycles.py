"""A time-local segment must not close a cycle through a region once both run as single calls."""

from __future__ import annotations

import operator

import torch.fx as fx

from gradshard.plans.adjoint.tail import _acyclic_once_collapsed


def _graph():
    """Region {e_a = -x, e_b = -p1} maps its two inputs separately; segment {p1 = |x|, p2 = p1 + e_a}
    is convex in this graph, but as calls: segment -> region (p1) and region -> segment (e_a)."""
    g = fx.Graph()
    x = g.placeholder("x")
    e_a = g.call_function(operator.neg, (x,), name="e_a")
    p1 = g.call_function(operator.abs, (x,), name="p1")
    e_b = g.call_function(operator.neg, (p1,), name="e_b")
    p2 = g.call_function(operator.add, (p1, e_a), name="p2")
    g.output((e_b, p2))
    return list(g.nodes), e_a, e_b, p1, p2


def test_a_segment_closing_a_cycle_through_a_region_is_dropped():
    order, e_a, e_b, p1, p2 = _graph()
    assert _acyclic_once_collapsed(order, [{e_a, e_b}], [{p1, p2}]) == []


def test_segments_outside_any_cycle_are_kept():
    order, e_a, e_b, p1, p2 = _graph()
    assert _acyclic_once_collapsed(order, [{e_a}, {e_b}], [{p1, p2}]) == [{p1, p2}]
    assert _acyclic_once_collapsed(order, [{e_a, e_b}], [{p1}, {p2}]) == [{p1}, {p2}]
