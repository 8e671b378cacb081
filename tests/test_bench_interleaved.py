"""bench/bench_interleaved.py: the graph-by-graph adjoint it times against the whole-shard one."""

from __future__ import annotations

import copy

import torch
from torch._dynamo.backends.debugging import aot_eager

import gradshard as gs
from gradshard.examples import factories
from gradshard.plans.adjoint.local import LocalSegment
from gradshard.plans.adjoint.runtime import AdjointRegion
from tests.bench_modules import load_bench


def test_graph_by_graph_switches_the_whole_shard_functions_off_and_stays_exact() -> None:
    bench = load_bench("bench_interleaved")
    model, (ids,) = factories.ssm(n_layers=2, seq_len=13, batch=2, dtype=torch.float64)
    ref = copy.deepcopy(model)
    cm = gs.compile(model, plan="adjoint", inductor=True, shard_size=4)
    cm.segment_compiler = aot_eager
    run = bench.graph_by_graph(cm)
    run(ids).square().mean().backward()  # first call: whole shards, then switched off
    regions = [m for m in cm.graph.modules() if isinstance(m, AdjointRegion)]
    tails = [m for m in cm.graph.modules() if isinstance(m, LocalSegment)]
    assert regions and tails and all(r.graphs.calls is None for r in regions + tails)
    model.zero_grad(set_to_none=True)
    run(ids).square().mean().backward()  # graph by graph
    assert all(r.graphs._graphs for r in regions)
    ref(ids).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-9, atol=1e-12)
