"""The adjoint, truncated-adjoint and LASP plans end to end on the Triton kernels (interpreter).

``backend="triton"`` makes ``lower_kernels`` point every region module at the Triton kernels
(scan, fused adjoint VJP shard, lightning attention). Under ``TRITON_INTERPRET=1`` they run on
CPU; the float64 gradients must equal the ``backend="torch"`` run (rel err <= 1e-10) and the
scheduled stages must name the Triton kernels. The work runs in a child pytest process because
Triton picks interpreter mode when the kernels are defined (at import).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.interpreted import INTERPRETED, run_under_interpreter

TOL = 1e-10


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float(a.norm())


if not INTERPRETED:

    @pytest.mark.slow  # every plan on the Triton interpreter (~75 s); the kernels' own interpreter test runs by default
    def test_plans_on_triton_under_interpreter():
        run_under_interpreter(__file__)

else:
    import gradshard as gs
    from examples import factories
    from gradshard.distributed.testing import run_threaded
    from gradshard.plans.lasp.runtime import local_slice

    def _adjoint_grads(factory: str, backend: str, plan: str, **options):
        model, inputs = getattr(factories, factory)(dtype=torch.float64, seq_len=13, batch=2)
        cm = gs.compile(model, plan=plan, backend=backend, **options)
        out = cm(*inputs)
        weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
        (out * weight).sum().backward()
        return cm, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    @pytest.mark.parametrize("factory,plan,options", [
        ("ssm", "adjoint", {"shard_size": 4}),                 # diagonal scan, fused VJP shard
        ("ssm_scalar_decay", "adjoint", {"shard_size": 5}),    # scalar-per-head decay
        ("ssm", "truncated_adjoint", {"window": 6}),           # blockwise windowed adjoint
    ])
    def test_adjoint_plans_triton_match_torch(factory, plan, options):
        _, ref = _adjoint_grads(factory, "torch", plan, **options)
        cm, got = _adjoint_grads(factory, "triton", plan, **options)
        assert set(got) == set(ref)
        worst = max(_rel(got[n], ref[n]) for n in ref)
        assert worst <= TOL, worst
        kernels = " ".join(s.kernel for s in cm.program.stages)
        assert "triton:" in kernels and "torch:" not in kernels, kernels

    def test_lasp_plan_triton_matches_torch():
        model, (ids,) = factories.linear_attention_gradshard(seq_len=23, batch=2, dtype=torch.float64)
        world = 2

        def run(backend):
            def body(rank, group):
                m = copy.deepcopy(model)
                cm = gs.compile(m, plan="lasp", group=group, backend=backend)
                o = cm(local_slice(ids, rank, world))
                weight = torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(rank))
                (o * weight).sum().backward()
                kernels = " ".join(s.kernel for s in cm.program.stages)
                return {n: p.grad.clone() for n, p in m.named_parameters()}, kernels

            return run_threaded(world, body, timeout_s=240.0, group_timeout_s=120.0)

        ref = run("torch")
        got = run("triton")
        for (g_ref, _), (g_got, kernels) in zip(ref, got):
            worst = max(_rel(g_got[n], g_ref[n]) for n in g_ref)
            assert worst <= TOL, worst
            assert "triton:lightning_attention" in kernels, kernels
