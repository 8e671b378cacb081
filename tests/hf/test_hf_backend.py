"""``torch.compile(model, backend=gs.backend(plan=...))`` on `transformers` models: the same
gradients as eager (issue 16, point 4). Dynamo captures the HF call (graph breaks included);
gradshard's backend rewrites each graph it is handed. Segments run without Inductor here
(``inductor=False``): Inductor's compile of every segment is tested in tests/compose. The last test
composes per-step recurrences of `transformers` models with a compiler (AOTAutograd): their shards
run as whole compiled functions."""

from __future__ import annotations

import copy

import pytest
import torch

import gradshard as gs

from .zoo import build, inputs

T = 37


@pytest.mark.parametrize("family, plan, options, tol", [
    ("llama", "none", {}, 1e-10),
    ("llama", "seco", {"chunk_size": 8}, 1e-10),
    ("mamba2", "adjoint", {"shard_size": 8}, 1e-5),  # computes part of its float64 forward in float32
])
def test_torch_compile_with_gradshard_backend_matches_eager(family: str, plan: str, options: dict, tol: float) -> None:
    model, config = build(family, fp64_loss=False)
    ref = copy.deepcopy(model)
    ids = inputs(config, batch=2, T=T)["input_ids"]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=gs.backend(plan=plan, inductor=False, **options))
    got, want = compiled(input_ids=ids).logits, ref(input_ids=ids).logits
    weights = torch.linspace(0.5, 1.5, got.numel(), dtype=got.dtype).reshape(got.shape)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert float((got - want).detach().abs().max() / want.detach().abs().max()) <= tol
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert float((q.grad - p.grad).abs().max() / p.grad.abs().max()) <= tol, name


# rwkv (41 s of Inductor compiles) runs in `make test-all`: the default suite stays under 15 min
@pytest.mark.parametrize("family", ["mamba", pytest.param("rwkv", marks=pytest.mark.slow)])
def test_composed_adjoint_runs_whole_shards_on_transformers_models(family: str) -> None:
    """`gs.compile(..., inductor=True)` (AOTAutograd as the compiler here) on per-step recurrences
    of `transformers` models: their shards run as whole compiled functions, with eager's gradients."""
    from torch._dynamo.backends.debugging import aot_eager

    from gradshard.plans.adjoint.runtime import AdjointRegion

    model, config = build(family, fp64_loss=False)
    ref = copy.deepcopy(model)
    ids = inputs(config, batch=2, T=T)["input_ids"]
    cm = gs.compile(model, plan="adjoint", inductor=True, shard_size=8)
    cm.segment_compiler = aot_eager
    got, want = cm(input_ids=ids).logits, ref(input_ids=ids).logits
    weights = torch.linspace(0.5, 1.5, got.numel(), dtype=got.dtype).reshape(got.shape)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    regions = [m for m in cm.graph.modules() if isinstance(m, AdjointRegion)]
    per_step = [r for r in regions if r.chunked is None]
    assert per_step and all(r.graphs.calls.variants and not r.graphs.calls.failed for r in per_step)
    assert float((got - want).detach().abs().max() / want.detach().abs().max()) <= 1e-5
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert float((q.grad - p.grad).abs().max() / p.grad.abs().max()) <= 1e-5, name
