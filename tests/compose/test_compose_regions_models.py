"""The adjoint tests' model family, composed: every region graph compiled (``aot_eager``), still
exact (float64, rel err <= 1e-10 against plain autograd), for each recurrence form the adjoint
plans serve: diagonal and dense, loops with per-step producers, a cumulative sum (no decay),
a final-state output, a causal conv (halo), the truncated adjoint, one-step shards."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager

from gradshard.plans.adjoint.runtime import AdjointRegion
from tests.adjoint.models import (CumsumMixer, DenseLoopSSM, DiagonalSSM, FinalStateSSM, LoopProducersRNN,
                                  init_like_training)

from .helpers import assert_exact


def _x(batch: int, T: int, d: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, T, d, dtype=torch.float64)


CASES = {
    "dense-loop-h0": lambda: (init_like_training(DenseLoopSSM(h0=True)), (_x(3, 7, 4),), "adjoint", {"shard_size": 3}),
    "loop-producers": lambda: (init_like_training(LoopProducersRNN(d=4)), (_x(1, 7, 4),), "adjoint", {"shard_size": 3}),
    "cumsum": lambda: (init_like_training(CumsumMixer(d=4)), (_x(2, 7, 4),), "adjoint", {"shard_size": 3}),
    "final-state": lambda: (init_like_training(FinalStateSSM()), (_x(2, 7, 4),), "adjoint", {"shard_size": 3}),
    "one-step-shards-conv": lambda: (init_like_training(DiagonalSSM(d=4, n=2, conv=True, scan="gradshard")),
                                     (_x(1, 5, 4),), "adjoint", {"shard_size": 1}),
    # a window as long as the sequence: the blockwise truncated sweep, equal to the exact adjoint
    "truncated-conv": lambda: (init_like_training(DiagonalSSM(d=4, n=2, conv=True, scan="gradshard")),
                               (_x(2, 9, 4),), "truncated_adjoint", {"shard_size": 4, "window": 9}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_region_graphs_are_exact(case: str) -> None:
    model, args, plan, options = CASES[case]()
    cm = assert_exact(model, args, plan, compiler=aot_eager, **options)
    regions = [m for m in cm.graph.modules() if isinstance(m, AdjointRegion)]
    assert regions
    for r in regions:
        assert r.graphs.compiled_variants > 0 and r.graphs.failures == 0


def test_windowed_truncated_adjoint_composed_equals_uncomposed() -> None:
    """A window shorter than the call: the forward shards run as whole compiled functions, the
    backward's corrected shards graph by graph; the windowed gradient is the uncomposed one's."""
    import copy

    import gradshard as gs

    torch.manual_seed(0)
    model = init_like_training(DiagonalSSM(d=4, n=2, conv=True, scan="gradshard"))
    other = copy.deepcopy(model)
    x = _x(2, 11, 4)
    grads = []
    for m, inductor in ((model, False), (other, True)):
        cm = gs.compile(m, plan="truncated_adjoint", inductor=inductor, window=5, shard_size=4)
        cm.segment_compiler = aot_eager
        cm(x).square().mean().backward()
        grads.append([p.grad for p in m.parameters()])
        if inductor:
            regions = [r for r in cm.graph.modules() if isinstance(r, AdjointRegion)]
            assert regions and all(r.graphs.calls.variants and not r.graphs.calls.failed for r in regions)
    for g, h in zip(*grads):
        assert torch.allclose(g, h, rtol=1e-10, atol=1e-12)
