"""The adjoint plan trains in bfloat16: its self-check allows the dtype's rounding (it refused
bf16 at every length before), and its gradient error against float64 stays within the dtype's
precision. float16 is not covered yet (see the README's Status)."""

from __future__ import annotations

import copy

import pytest
import torch

import gradshard as gs
from examples.factories import ssm


def _grads(model: torch.nn.Module, ids: torch.Tensor, run) -> list[torch.Tensor]:
    out = run(ids)
    w = torch.linspace(0.5, 1.5, out.numel(), dtype=torch.float64).reshape(out.shape)
    (out.double() * w).sum().backward()
    return [p.grad.double() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_adjoint_low_precision_gradients_as_good_as_eager(dtype: torch.dtype) -> None:
    model, (ids,) = ssm(seq_len=1024)
    ref = copy.deepcopy(model).double()
    truth = _grads(ref, ids, ref)
    eager = copy.deepcopy(model).to(dtype)
    mine = copy.deepcopy(model).to(dtype)
    eager_g = _grads(eager, ids, eager)
    mine_g = _grads(mine, ids, gs.compile(mine, plan="adjoint", shard_size=128))

    def err(gs_: list[torch.Tensor]) -> float:
        return max(float((g - t).abs().max() / t.abs().max()) for g, t in zip(gs_, truth))

    mine_err, eager_err = err(mine_g), err(eager_g)
    # Measured on CPU: adjoint 3.0e-2 (bf16); eager's bf16 gradients on this model come out
    # NaN (not yet explained), so compare with eager only where they are finite.
    bound = 6e-2
    assert mine_err <= bound, mine_err
    if eager_err == eager_err:
        assert mine_err <= 1.5 * eager_err + 1e-3, (mine_err, eager_err)
