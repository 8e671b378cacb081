"""``torch.compile(model, backend=gs.backend(plan=...))`` on `transformers` models: the same
gradients as eager (issue 16, point 4). Dynamo captures the HF call (graph breaks included);
gradshard's backend rewrites each graph it is handed. Segments run without Inductor here
(``inductor=False``): Inductor's compile of every segment is tested in tests/compose."""

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
