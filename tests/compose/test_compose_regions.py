"""Composed with a compiler, regions compile what they run per shard (issue 19 point 2).

``adjoint`` regions compile each per-step shard whole (forward and backward), ``tail`` segments
and chunked shards their graphs, once per window length and input signature, cached on the
region; a compile failure leaves that function or graph eager; gradients stay exact (float64, against plain autograd). ``seco`` keeps each chunk's
attention output for its backward instead of recomputing it. Most tests use ``aot_eager``
(AOTAutograd without code generation: the same compiled-function boundaries as Inductor);
one runs Inductor itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch.utils._python_dispatch import TorchDispatchMode

import gradshard as gs
from gradshard.examples import factories
from gradshard.plans.adjoint.local import LocalSegment, segment_vjp
from gradshard.plans.adjoint.runtime import AdjointRegion
from gradshard.plans.adjoint.shards import forward_shard, shard_vjp
from gradshard.plans.chunked.runtime import ChunkedRegion
from gradshard.runtime.compiled import CompiledCalls, GraphVariants, RegionGraphs
from tests.adjoint.models import DiagonalSSM, SsdNet, init_like_training

from .helpers import assert_exact, composed

_FLASH_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _regions(cm: gs.CompiledModule, kind: type) -> list:
    return [m for m in cm.graph.modules() if isinstance(m, kind)]


def _x(batch: int, T: int, d: int, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(batch, T, d, dtype=torch.float64)


def _step(cm: gs.CompiledModule, x: torch.Tensor) -> None:
    cm(x).square().sum().backward()


def test_adjoint_regions_compile_whole_shards_once_per_window_and_mode() -> None:
    """Per-step shards run as whole compiled functions: the forward shard (producers, scan,
    readout) and the backward shard (recompute, readout VJP, adjoint scan, producers' VJP), one
    variant per window -- the first without a left halo, the full ones, the ragged last one."""
    # conv: a halo of 2 steps, so the first window is shorter than the others; T=11, shard 4: a ragged last shard
    model = init_like_training(DiagonalSSM(d=6, n=3, heads=2, conv=True, h0=True, scan="gradshard"))
    x = _x(2, 11, 6)
    cm = assert_exact(model, (x,), "adjoint", compiler=aot_eager, shard_size=4)
    regions = _regions(cm, AdjointRegion)
    assert regions and all(r.graphs.compiler.compiler is aot_eager for r in regions)  # shared by the regions
    for r in regions:
        calls, halo = r.graphs.calls, r.io.halo[0]
        assert not calls.failed and not r.graphs._graphs  # nothing graph by graph
        windows = {(4, 0, 4), (4 + halo, halo, 4), (3 + halo, halo, 3)}  # (length, start, steps)
        fwd = {tuple(f[1] for f in key[1][1:4]) for key in calls.variants if key[0] is forward_shard}
        bwd = {tuple(f[1] for f in key[1][2:5]) for key in calls.variants if key[0] is shard_vjp}
        assert fwd == windows and bwd == windows, (fwd, bwd)
    before = [r.graphs.compiled_variants for r in regions]
    for _ in range(2):  # later steps run the cached variants: nothing compiles again
        _step(cm, x.clone().requires_grad_())
    assert [r.graphs.compiled_variants for r in regions] == before
    assert "whole-shard function(s)" in cm.explain()


def test_tail_segments_compile_their_shards_too() -> None:
    model, (ids,) = factories.ssm(n_layers=2, seq_len=13, batch=2, dtype=torch.float64)
    cm = assert_exact(model, (ids,), "adjoint", compiler=aot_eager, shard_size=4)
    tails = _regions(cm, LocalSegment)
    assert tails, "the example SSM's final norm and head run as a tail segment"
    for t in tails:
        # the forward runs the subgraph compiled per shard length; each backward shard (recompute and
        # VJP) is one compiled function, a variant per window
        assert set(t.graphs._graphs) == {4, 1} and not t.graphs.calls.failed
        assert {tuple(f[1] for f in key[1][2:5]) for key in t.graphs.calls.variants if key[0] is segment_vjp} == {
            (4, 0, 4), (1, 0, 1)}


def test_without_a_compiler_regions_run_their_graphs_eagerly() -> None:
    model = init_like_training(DiagonalSSM(d=6, n=3, conv=True, scan="gradshard"))
    cm = gs.compile(model, plan="adjoint", shard_size=4)  # inductor=False
    _step(cm, _x(1, 9, 6).requires_grad_())
    for r in _regions(cm, AdjointRegion):
        assert r.graphs.compiler is None and not r.graphs._graphs
        assert isinstance(r.runner("producer", 4), torch.fx.GraphModule)


def test_a_graph_the_compiler_refuses_runs_eagerly_and_stays_exact(caplog) -> None:
    def segments_only(gm: torch.fx.GraphModule, example_inputs: list):
        if type(gm).__name__ != "GradshardStep":  # composed segments; region graphs keep their class
            raise RuntimeError("no kernel for this op")
        return aot_eager(gm, example_inputs)

    segments_only.display_name = "aot_eager"
    model, (ids,) = factories.ssm(n_layers=1, seq_len=11, batch=1, dtype=torch.float64)
    with caplog.at_level("WARNING", logger="gradshard"):
        cm = assert_exact(model, (ids,), "adjoint", compiler=segments_only, shard_size=4)
    (region,) = _regions(cm, AdjointRegion)
    # the whole-shard functions fail first, then each graph of them: everything runs eagerly
    assert region.graphs.calls.failed == {forward_shard, shard_vjp} and not region.graphs.calls.variants
    assert region.graphs._graphs and all(fn is g.gm for g in region.graphs._graphs.values() for fn in g.variants.values())
    messages = [r.getMessage() for r in caplog.records]
    assert any("could not compile adjoint_0's forward_shard" in m and "no kernel for this op" in m for m in messages)
    assert any("could not compile adjoint_0:producer" in m and "no kernel for this op" in m for m in messages)
    assert "left eager (compile failed)" in cm.explain()


def test_variants_follow_the_signature_and_copies_start_empty() -> None:
    calls = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list):
        calls.append(tuple(x.shape for x in example_inputs if isinstance(x, torch.Tensor)))
        return gm

    g = torch.fx.symbolic_trace(lambda a, b: (a * b + 1,))
    graphs = RegionGraphs("r")
    assert graphs.get("k", lambda: g) is g  # no compiler: the graph itself
    graphs.set_compiler(counting)
    run = graphs.get("k", lambda: g)
    assert isinstance(run, GraphVariants) and graphs.get("k", lambda: g) is run
    a, b = torch.randn(3), torch.randn(3)
    run(a, b)
    run(a, b)
    assert len(calls) == 1
    run(torch.randn(4), torch.randn(4))  # another shape
    with torch.no_grad():
        run(a, b)  # another grad mode
    run(a.requires_grad_(), b)  # another requires_grad flag
    assert len(calls) == 4 and graphs.compiled_variants == 4
    clone = copy.deepcopy(graphs)
    assert clone.compiler is counting and clone.compiled_variants == 0
    graphs.set_compiler(None)
    assert graphs.compiled_variants == 0 and graphs.get("k", lambda: g) is g


def test_a_region_called_at_ever_new_lengths_stops_compiling(monkeypatch) -> None:
    import gradshard.runtime.compiled as compiled

    monkeypatch.setattr(compiled, "MAX_GRAPHS", 2)
    g = torch.fx.symbolic_trace(lambda a: (a + 1,))
    graphs = RegionGraphs("r")
    graphs.set_compiler(lambda gm, example_inputs: gm)
    assert isinstance(graphs.get(("producer", 4), lambda: g), GraphVariants)
    assert isinstance(graphs.get(("producer", 3), lambda: g), GraphVariants)
    assert graphs.get(("producer", 5), lambda: g) is g  # the third length runs eagerly
    assert graphs.capped and "the rest run eagerly" in graphs.describe()
    assert isinstance(graphs.get(("producer", 4), lambda: g), GraphVariants)  # known ones stay compiled


def test_whole_shard_variants_past_the_cap_run_graph_by_graph(monkeypatch, caplog) -> None:
    """Past MAX_GRAPHS whole-shard variants a region runs new windows graph by graph (logged once),
    exactly."""
    import gradshard.runtime.compiled as compiled

    monkeypatch.setattr(compiled, "MAX_GRAPHS", 3)
    model = init_like_training(DiagonalSSM(d=6, n=3, heads=2, conv=True, h0=True, scan="gradshard"))
    with caplog.at_level("WARNING", logger="gradshard"):
        cm = assert_exact(model, (_x(2, 11, 6),), "adjoint", compiler=aot_eager, shard_size=4)
    for r in _regions(cm, AdjointRegion):
        assert len(r.graphs.calls.variants) == 3 and r.graphs.calls.capped and not r.graphs.calls.failed
        assert r.graphs._graphs  # the windows past the cap, graph by graph
    assert any("function variants (window lengths); new ones run graph by graph" in rec.getMessage()
               for rec in caplog.records)


class _CountOps(TorchDispatchMode):
    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


def _flash_forwards_in_backward(cm: gs.CompiledModule, ids: torch.Tensor) -> int:
    loss = cm(ids).square().sum()
    with _CountOps(_FLASH_FWD) as mode:
        loss.backward()
    return mode.count


def test_seco_compiles_local_groups_keeps_attention_outputs_and_stays_exact() -> None:
    model, (ids,) = factories.llama(n_layers=2, seq_len=13, batch=2, dtype=torch.float64)
    eager = gs.compile(copy.deepcopy(model), plan="seco", chunk_size=5)
    assert _flash_forwards_in_backward(eager, ids) > 0  # recomputed without a compiler
    (plain,) = _regions(eager, ChunkedRegion)
    assert plain.group_runners() is None and not plain.stash_attention
    cm = assert_exact(model, (ids,), "seco", compiler=aot_eager, chunk_size=5)
    (region,) = _regions(cm, ChunkedRegion)
    assert region.stash_attention
    groups = region.compiled_groups
    # one group per layer boundary (post-attention block + next pre-attention block) and the ends
    assert len(groups.runners) >= 3 and groups.failures == 0
    assert sum(len(r.group.members) for r in groups.runners) > len(region.program.rules) // 2
    # chunk widths 5 and 3 (13 = 5 + 5 + 3), forward and backward recompute: at most 4 variants a group
    assert all(1 <= len(r.variants) <= 4 for r in groups.runners)
    before = groups.compiled_variants
    assert _flash_forwards_in_backward(cm, ids) == 0  # taken from the forward
    assert groups.compiled_variants == before  # the second step compiles nothing
    text = cm.explain()
    assert "attention outputs kept from the forward" in text and "group(s) of local nodes" in text
    with torch.no_grad():  # no backward to serve: nothing is kept
        assert not cm(ids).requires_grad


def test_inductor_compiles_region_graphs_exactly() -> None:
    # the shapes of test_compose_inductor's backend test: Inductor's on-disk cache serves the second
    model, (ids,) = factories.ssm(n_layers=1, seq_len=11, batch=2, dtype=torch.float64)
    cm = assert_exact(model, (ids,), "adjoint", shard_size=4)
    (region,) = _regions(cm, AdjointRegion)
    assert region.graphs.compiled_variants > 0 and region.graphs.failures == 0
    assert "compiled by Inductor" in region.graphs.describe()
    # every variant is compiled code, not the traced function or the graph
    assert region.graphs.calls.variants and not region.graphs.calls.failed
    assert not any(isinstance(fn, torch.fx.GraphModule) for fn in region.graphs.calls.variants.values())
    for g in region.graphs._graphs.values():
        assert all(fn is not g.gm and not isinstance(fn, torch.fx.GraphModule) for fn in g.variants.values())


@pytest.mark.slow  # default suite under 15 min on 2 cores: Inductor on the fallback path; runs in `make test-all`
def test_compiled_producers_trim_their_outputs_inside_the_graph(monkeypatch) -> None:
    """Graph by graph (the path a shard takes when its whole function does not compile), the
    producers' outputs are trimmed to the shard inside their compiled graph, so autograd never
    sees window-sized outputs (nor zero-fills their gradients)."""
    def graphs_only(self: RegionGraphs, compiler, set_compiler=RegionGraphs.set_compiler) -> None:
        set_compiler(self, compiler)
        self.calls = None

    monkeypatch.setattr(RegionGraphs, "set_compiler", graphs_only)
    # a conv: each shard's producers run on a window of 2 + 4 steps; u = b x^T is state-sized
    model = init_like_training(DiagonalSSM(d=6, n=3, heads=2, layers=1, conv=True, scan="gradshard"))
    x = _x(1, 8, 6)  # two shards: the second's window has the halo (no ragged shard: fewer Inductor compiles)
    cm = assert_exact(model, (x,), "adjoint", shard_size=4)
    (region,) = _regions(cm, AdjointRegion)
    windowed: list = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dim() == 5 and out.shape[1] == 6:  # states of a window
                windowed.append(func)
            return out

    loss = cm(x.clone().requires_grad_(True)).square().sum()
    with Watch():
        loss.backward()
    # trimmed outside the compiled graph, autograd zero-filled a window-sized gradient of u per shard
    assert not windowed, windowed
    producers = [k for k in region.graphs._graphs if k[0] == "producer"]
    assert producers and all(len(k) == 4 for k in producers)


def test_chunked_regions_compile_their_shard_graphs_exactly() -> None:
    """Both block forms compiled: SSD's from the log-decay (plain ops) and the lightning_attention
    custom op (a sigmoid decay); one graph per shard, no producer graphs. The custom op runs
    under Inductor itself (what Inductor must schedule around); the plain-op form under
    AOTAutograd alone (the same graph boundaries, without a cold Inductor compile of each variant)."""
    for decay, compiler in (("exp", aot_eager), ("sigmoid", None)):
        torch.manual_seed(0)
        model = SsdNet(layers=1, decay=decay).double()
        cm = assert_exact(model, (_x(2, 13, 6),), "adjoint", compiler=compiler, shard_size=4)
        (region,) = _regions(cm, AdjointRegion)
        assert region.chunked is not None and region.graphs.failures == 0
        assert {k[0] for k in region.graphs._graphs} == {"shard"} and region.graphs.compiled_variants >= 3


def test_layers_cut_alike_compile_their_graphs_once() -> None:
    """Every layer's shard graph has one structure: the program compiles each variant once."""
    calls: list[int] = []

    def counting(gm, example_inputs):
        calls.append(len(gm.graph.nodes))
        return aot_eager(gm, example_inputs)

    torch.manual_seed(0)
    model = SsdNet(layers=3).double()
    cm = assert_exact(model, (_x(2, 13, 6),), "adjoint", compiler=counting, shard_size=4)
    regions = _regions(cm, AdjointRegion)
    variants = [r.graphs.compiled_variants for r in regions]
    assert len(regions) == 3 and variants[0] == variants[1] == variants[2] > 0
    assert len(calls) == variants[0]  # the other two layers reuse layer 0's compiled variants
    assert regions[0].graphs.compiler.hits == variants[1] + variants[2]


def test_seco_runs_ssd_block_form_compiled_and_stays_exact() -> None:
    """seco's block-read SSD scans (the readout's block form from the carried state) run as
    compiled functions under a compiler: one variant per chunk width and grad mode, exact.
    (AOTAutograd without Inductor: what is checked is the dispatch, and Inductor's cold compile
    of six variants would cost a minute of the suite.)"""
    torch.manual_seed(0)
    model = SsdNet(layers=2, decay="exp").double()
    cm = assert_exact(model, (_x(2, 13, 6),), "seco", compiler=aot_eager, chunk_size=5)
    (region,) = _regions(cm, ChunkedRegion)
    calls = region.compiled_calls()
    # three windows -- the first chunk (no state before it), the next (a state), the last (width 3) --
    # each without grad (the forward) and with it (the backward's recompute), shared by both layers
    assert calls is not None and not calls.failed and len(calls.variants) == 6
    assert all(key[0].__name__ == "block_scan" for key in calls.variants)
    before = len(calls.variants)
    _step(cm, _x(2, 13, 6, seed=2))
    assert len(calls.variants) == before  # the second step compiles nothing
    assert "6 compiled block-form call(s)" in cm.explain()


def test_compiled_calls_fix_non_tensors_and_fall_back_when_the_compiler_refuses(caplog) -> None:
    seen: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list):
        seen.append(len(example_inputs))
        return aot_eager(gm, example_inputs)

    def f(a: torch.Tensor, scale: float, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return (a * scale, a.sin() if b is None else a + b)

    calls = CompiledCalls(counting, "r")
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y, z = calls(f, a, 2.0, None)
    (y.sum() + z.sum()).backward()  # differentiable
    assert torch.allclose(a.grad, 2 + a.detach().cos())
    calls(f, a, 2.0, None)
    calls(f, a, 3.0, None)  # another fixed value
    calls(f, a, 2.0, torch.ones(3))  # another tensor argument
    assert seen == [1, 1, 2] and len(calls.variants) == 3

    def refusing(gm, example_inputs):
        raise RuntimeError("no kernel for this op")

    calls = CompiledCalls(refusing, "r")
    with caplog.at_level("WARNING", logger="gradshard"):
        y, z = calls(f, a, 2.0, None)
        calls(f, a, 2.0, None)
    assert torch.equal(y, a * 2) and f in calls.failed and not calls.variants
    assert sum("could not compile r's" in r.getMessage() for r in caplog.records) == 1


def test_whole_shard_variants_follow_the_autocast_state() -> None:
    """A trace bakes autocast's casts in: a call under autocast after one without compiles its own
    variants, and each mode's gradients are the uncomposed plan's in that mode."""
    model, (ids,) = factories.ssm(n_layers=2, seq_len=13, batch=2)
    plain = copy.deepcopy(model)
    composed_cm = gs.compile(model, plan="adjoint", inductor=True, shard_size=4)
    composed_cm.segment_compiler = aot_eager
    plain_cm = gs.compile(plain, plan="adjoint", shard_size=4)

    def grads(cm: gs.CompiledModule, owner: torch.nn.Module, autocast: bool) -> list[torch.Tensor]:
        owner.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = cm(ids)
        out.float().square().mean().backward()
        return [p.grad for p in owner.parameters()]

    counts = []
    for autocast in (False, True, False):
        for g, want in zip(grads(composed_cm, model, autocast), grads(plain_cm, plain, autocast)):
            assert torch.allclose(g, want, rtol=1e-3, atol=1e-6), autocast
        counts.append(sum(len(r.graphs.calls.variants) for r in _regions(composed_cm, AdjointRegion)))
    assert counts[0] < counts[1] == counts[2]  # autocast's own variants; the third call reuses the first's
