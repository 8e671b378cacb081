"""Composition without Inductor's cost: how a rewritten graph is cut into segments and regions,
and exactness of every plan family when the segments are compiled through AOTAutograd
(``aot_eager``: the same autograd.Function boundaries Inductor gets, no code generation)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager

import gradshard as gs
from gradshard.compose import compose_graph, is_region_node
from gradshard.examples import factories
from tests.adjoint.models import DiagonalSSM, FinalStateSSM, StateFirstS4D, init_like_training
from tests.core.models import LoopRNN, SDPABlock

from .helpers import assert_exact, composed


def _x(batch: int, T: int, d: int, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(batch, T, d, dtype=torch.float64)


@pytest.fixture(scope="module")
def adjoint_hybrid() -> gs.CompiledModule:
    """The example hybrid (SSM / attention / SSM / attention) under plan adjoint, checked exact."""
    model, (ids,) = factories.hybrid(seq_len=11, batch=1, dtype=torch.float64)
    return assert_exact(model, (ids,), "adjoint", compiler=aot_eager, shard_size=4)


def test_segments_alternate_with_regions_and_cover_the_graph(adjoint_hybrid: gs.CompiledModule) -> None:
    cm = adjoint_hybrid
    gm = cm.graph
    c = composed(cm)
    kinds = [s.kind for s in c.segments]
    assert "region" in kinds and "compiled" in kinds
    by_name = {n.name: n for n in gm.graph.nodes}
    for s in c.segments:
        regions = [n for n in s.nodes if is_region_node(gm, by_name[n])]
        # a region step is one region node (plus the getitems unpacking it); segments hold none
        assert len(regions) == (1 if s.kind == "region" else 0), s
    # the attention layers of the hybrid are plain segments: compiled, not regions
    attn = [s for s in c.segments if any("scaled_dot_product_attention" in n for n in s.nodes)]
    assert attn and all(s.kind == "compiled" for s in attn)
    # every computing node runs in exactly one step
    listed = [n for s in c.segments for n in s.nodes]
    assert len(listed) == len(set(listed))
    assert set(listed) == {n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")}
    # a step reads only values computed before it
    seen = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    for s in c.segments:
        assert set(s.inputs) <= seen, s.name
        seen |= set(s.outputs)
    assert c.compiled_variants == len(c.compiled_segments)  # one variant each: one signature


def test_values_are_dropped_after_their_last_reader(adjoint_hybrid: gs.CompiledModule) -> None:
    cm = adjoint_hybrid
    c = composed(cm)
    frees = c._frees
    outputs = {n.name for n in cm.graph.graph.output_node().all_input_nodes}
    dropped = [n for f in frees for n in f]
    assert len(dropped) == len(set(dropped)) and not set(dropped) & outputs
    for i, f in enumerate(frees):
        for name in f:
            readers = [j for j, s in enumerate(c.segments) if name in s.inputs]
            assert max(readers) == i, name
    # every value handed on by a step is read later or returned: none is kept for nothing
    produced = {n for s in c.segments for n in s.outputs}
    assert produced <= set(dropped) | outputs


def test_program_and_explain_say_what_is_compiled(adjoint_hybrid: gs.CompiledModule) -> None:
    cm = adjoint_hybrid
    text = cm.explain()
    assert "compose: " in text and "segment(s) compiled by aot_eager" in text
    assert "region (not compiled" in text
    kernels = {s.kernel.split(" ")[0] for s in cm.program.stages if s.region is None and s.nodes}
    assert "aot_eager" in kernels
    assert all(s.kernel != "aot_eager" for s in cm.program.stages if s.region is not None)


def test_default_runs_the_graph_eagerly_and_the_flag_is_checked() -> None:
    model = SDPABlock().double()
    cm = gs.compile(model, plan="none")
    cm(_x(1, 5, 8))
    assert "inductor" not in cm.current.extras
    with pytest.raises(gs.GradshardError, match="inductor must be True or False"):
        gs.compile(model, plan="none", inductor="yes")
    with pytest.raises(gs.GradshardError, match="inductor must be True or False"):
        gs.backend(plan="none", inductor=1)


def test_no_grad_call_compiles_its_own_variant() -> None:
    model = SDPABlock().double()
    x = _x(2, 5, 8)
    cm = gs.compile(model, plan="none", inductor=True)
    cm.segment_compiler = aot_eager
    cm(x).sum().backward()
    c = composed(cm)
    assert c.compiled_variants == 1
    with torch.no_grad():
        out = cm(x)
    assert composed(cm) is c  # the same specialisation ...
    assert c.compiled_variants == 2  # ... but grad mode is part of a variant's signature
    assert not out.requires_grad
    assert torch.allclose(out, model(x), rtol=1e-12, atol=1e-12)
    cm(x)
    assert c.compiled_variants == 2


class _SkippedS4D(torch.nn.Module):
    """StateFirstS4D (one region, its residual add included) and a skip outside it: a segment."""

    def __init__(self) -> None:
        super().__init__()
        self.s4d = StateFirstS4D()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.s4d(x) - 0.5 * x


def test_respecialised_length_is_composed_anew() -> None:
    model = init_like_training(_SkippedS4D())
    ref = copy.deepcopy(model)
    cm = assert_exact(model, (_x(2, 11, 5),), "adjoint", compiler=aot_eager, shard_size=4)
    first = composed(cm)
    model.zero_grad()
    x = _x(2, 23, 5)  # the same module at another length: served by re-specialising, not captured
    out = cm(x.clone().requires_grad_())  # (the first call's input required grad too)
    assert "respecialized_from" in cm.current.extras
    second = composed(cm)
    assert second is not first and second.source is cm.current.gm
    assert second.compiled_variants == len(second.compiled_segments) > 0
    want = ref(x)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    want.square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert ((p.grad - q.grad).norm() / q.grad.norm()).item() <= 1e-10


# ------------------------------------------------------------------ every plan family, both modes

CASES = {
    # tests/core (plan none): examples and user-written blocks
    "none-ssm": lambda: (*factories.ssm(seq_len=13, batch=3, dtype=torch.float64), "none", {}),
    "none-llama_loss": lambda: (*factories.llama_loss(seq_len=11, batch=3, dtype=torch.float64), "none",
                                {"model_arg": 0}),
    "none-loop_rnn": lambda: (LoopRNN().double(), (_x(3, 7, 8),), "none", {}),
    # tests/adjoint
    "adjoint-diagonal-loop": lambda: (init_like_training(DiagonalSSM(scan="loop")), (_x(1, 11, 6),), "adjoint",
                                      {"shard_size": 4}),
    "adjoint-conv-h0-heads": lambda: (init_like_training(DiagonalSSM(d=6, n=3, heads=2, conv=True, h0=True,
                                                                     scan="gradshard")),
                                      (_x(3, 11, 6),), "adjoint", {"shard_size": 4}),
    "adjoint-final-state": lambda: (init_like_training(FinalStateSSM()), (_x(2, 11, 4),), "adjoint",
                                    {"shard_size": 3}),
    "truncated-ssm": lambda: (*factories.ssm(seq_len=13, batch=2, dtype=torch.float64), "truncated_adjoint",
                              {"window": 13, "shard_size": 4}),
    "adjoint-ssm-recomputed-inputs": lambda: (*factories.ssm(seq_len=13, batch=2, n_layers=4, dtype=torch.float64),
                                              "adjoint", {"shard_size": 4, "recompute_layer_inputs": True}),
    # tests/chunked
    "seco-llama": lambda: (*factories.llama(seq_len=13, batch=2, dtype=torch.float64), "seco", {"chunk_size": 5}),
    "seco-scan-rope": lambda: (_scan_rope(), (_x(2, 17, 16, seed=3),), "seco", {"chunk_size": 4}),
}


def _scan_rope() -> torch.nn.Module:
    from chunked_models import ScanRoPELM

    torch.manual_seed(2)
    return ScanRoPELM().double()


# the 4-layer recomputed-inputs case (19 s) runs in `make test-all`: the default suite stays under 15 min
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "adjoint-ssm-recomputed-inputs" else c
                                  for c in sorted(CASES)])
def test_plans_exact_with_compiled_segments(case: str) -> None:
    model, args, plan, options = CASES[case]()
    model_arg = options.pop("model_arg", None)
    cm = assert_exact(model, args, plan, compiler=aot_eager, model_arg=model_arg, **options)
    c = composed(cm)
    assert c.compiled_variants == len(c.compiled_segments)
    if plan in ("none",):
        assert len(c.compiled_segments) == 1 and not any(s.kind == "region" for s in c.segments)
    if plan in ("adjoint", "truncated_adjoint"):
        assert any(s.kind == "region" for s in c.segments)


def test_a_graph_without_regions_is_one_segment() -> None:
    model = SDPABlock().double()
    cm = gs.compile(model, plan="none")
    cm(_x(1, 5, 8))
    c = compose_graph(cm.graph, aot_eager)
    assert [s.kind for s in c.segments] == ["compiled"]
    assert c.compiled_variants == 0  # compiled at the first call, not before


def test_a_compiler_failure_names_the_segment_and_the_way_out() -> None:
    def broken(gm: torch.fx.GraphModule, example_inputs: list) -> None:
        raise RuntimeError("no kernel for this op")

    broken.display_name = "Inductor"
    model = SDPABlock().double()
    cm = gs.compile(model, plan="none", inductor=True)
    cm.segment_compiler = broken
    with pytest.raises(gs.GradshardError) as info:
        cm(_x(1, 5, 8))
    text = str(info.value)
    assert "Inductor could not compile segment_0" in text and "no kernel for this op" in text
    assert "inductor=False" in text
