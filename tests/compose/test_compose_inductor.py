"""Inductor compiles the segments a plan leaves alone; gradients stay exact (float64).

Each test compiles a few tiny graphs with Inductor (seconds each on CPU; Inductor's on-disk
caches make repeated runs faster).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters

import gradshard as gs
from gradshard.examples import factories

from .helpers import TOL, assert_exact, composed


def _inductor_compiles() -> int:
    """Graphs Inductor has compiled or served from its FX graph cache in this process."""
    c = counters["inductor"]
    return sum(c[k] for k in ("fxgraph_cache_miss", "fxgraph_cache_hit", "fxgraph_cache_bypass"))


def test_plan_none_is_one_inductor_segment_exact() -> None:
    model, (ids,) = factories.ssm(n_layers=1, seq_len=11, batch=2, dtype=torch.float64)
    before = _inductor_compiles()
    cm = assert_exact(model, (ids,), "none")
    c = composed(cm)
    assert [s.kind for s in c.segments] == ["compiled"] and c.compiler_name == "Inductor"
    assert c.compiled_variants == 1
    assert _inductor_compiles() >= before + 2  # the forward and the backward graph
    assert "1 segment(s) compiled by Inductor" in cm.explain()
    assert {s.kernel.split(" ")[0] for s in cm.program.stages if s.nodes} == {"inductor"}


@pytest.mark.slow  # default suite under 15 min on 2 cores; runs in `make test-all` (aot_eager covers adjoint exactness by default)
def test_adjoint_hybrid_attention_by_inductor_recurrences_by_regions() -> None:
    model, (ids,) = factories.hybrid(seq_len=11, batch=1, dtype=torch.float64)
    before = _inductor_compiles()
    cm = assert_exact(model, (ids,), "adjoint", shard_size=4)
    c = composed(cm)
    regions = [s.name for s in c.segments if s.kind == "region"]
    assert any(r.startswith("adjoint_") for r in regions)
    attn = [s for s in c.segments if any("scaled_dot_product_attention" in n for n in s.nodes)]
    assert len(attn) == 2 and all(s.kind == "compiled" for s in attn)
    assert c.compiled_variants == len(c.compiled_segments)
    assert _inductor_compiles() > before


def test_seco_region_is_the_whole_graph() -> None:
    # seco runs the captured graph chunk by chunk inside one region: nothing is left to compile.
    # (The split does not depend on the compiler: AOTAutograd alone spares the cold Inductor
    # compile of the region's local groups, which test_compose_regions covers.)
    model, (ids,) = factories.llama(n_layers=1, seq_len=13, batch=2, dtype=torch.float64)
    cm = assert_exact(model, (ids,), "seco", compiler=aot_eager, chunk_size=5)
    c = composed(cm)
    assert [s.kind for s in c.segments] == ["region"] and not c.compiled_segments


def test_torch_compile_backend_compiles_segments_with_inductor() -> None:
    model, (ids,) = factories.ssm(n_layers=1, seq_len=11, batch=2, dtype=torch.float64)
    ref = copy.deepcopy(model)
    be = gs.backend(plan="adjoint", shard_size=4)
    fast = torch.compile(model, backend=be, dynamic=False)
    for _ in range(2):  # the second call runs the compiled variants again
        model.zero_grad()
        fast(ids).square().mean().backward()
    ref(ids).square().mean().backward()
    (entry,) = be.compiled
    c = entry.extras["inductor"]
    # the region takes the whole layer (embedding to residual add) and a segment the norm and head:
    # what Inductor compiles is their per-shard graphs, and any segment left between them
    assert c.compiled_variants == len(c.compiled_segments)
    regions = [s for s in c.segments if s.kind == "region"]
    assert regions
    by_name = {n.name: n for n in c.source.graph.nodes}
    for s in regions:
        assert c.source.get_submodule(str(by_name[s.nodes[0]].target)).graphs.compiled_variants > 0, s.name
    for p, q in zip(model.parameters(), ref.parameters()):
        assert ((p.grad - q.grad).norm() / q.grad.norm()).item() <= TOL
