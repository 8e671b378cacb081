"""transformers' recurrent families trained under ``torch.autocast(bfloat16)``, the way users
train: the first call (the compile) runs inside the autocast block, so the captured graph
holds autocast's casts (``_to_copy(x, dtype=bfloat16)`` around each matmul, inside Mamba-2's
SSD blocks too). The recognisers prove a region in float64 with those casts widened
(``gradshard.passes.region_proof.widen_float_dtypes``) and outside autocast, so a cast no longer
hides a recurrence: Mamba-2 was refused under autocast ("no linear recurrence") before.

Contract: every plan's gradient (backward outside the block, PyTorch's AMP recipe) is as close
to the float64 model's as eager autocast's. Measured at T=37 over the 14 recurrent families x
{adjoint, seco}: the worst ratio to eager's error 1.08 (nemotron_h seco).
"""

from __future__ import annotations

import pytest
import torch

import gradshard as gs

from .zoo import RECURRENT, build, inputs

#: A plan rounds in another order than eager (scans accumulate in float32, chunks recompute).
SLACK = 1.25
DEFAULT = [("mamba2", "adjoint"), ("mamba2", "seco"), ("qwen3_next", "adjoint")]
#: The recurrent layers of the toy models (the rest are attention layers).
RECURRENT_LAYERS = {"mamba2": 2, "qwen3_next": 1}
SLOW = [(f, p) for f in sorted(RECURRENT) for p in ("adjoint", "seco") if (f, p) not in DEFAULT]


def _grads(model: torch.nn.Module, run: torch.nn.Module, batch: dict) -> torch.Tensor:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = run(**batch).loss
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()


def _check(family: str, plan: str) -> gs.CompiledModule:
    model, config = build(family)  # float64: the reference
    batch = inputs(config, batch=2, T=37)
    model(**batch).loss.backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model = model.float()
    eager = _grads(model, model, batch)
    cm = gs.compile(model, plan=plan, **({"chunk_size": 16} if plan == "seco" else {}))
    got = _grads(model, cm, batch)
    err, eager_err = float((got - ref).norm() / ref.norm()), float((eager - ref).norm() / ref.norm())
    assert err <= SLACK * eager_err + 1e-4, (family, plan, err, eager_err)
    return cm


@pytest.mark.parametrize("family, plan", DEFAULT, ids=["-".join(c) for c in DEFAULT])
def test_plans_under_bf16_autocast_are_as_close_to_float64_as_eager(family: str, plan: str) -> None:
    cm = _check(family, plan)
    if plan == "adjoint":  # the recurrences were found through the casts, not left to autograd
        text = cm.explain()
        assert text.count("- linear_recurrence adjoint_") == RECURRENT_LAYERS[family], text
        if family == "mamba2":
            assert "SSD block scan" in text, text


@pytest.mark.slow
@pytest.mark.parametrize("family, plan", SLOW, ids=["-".join(c) for c in SLOW])
def test_every_recurrent_family_under_bf16_autocast(family: str, plan: str) -> None:
    _check(family, plan)
