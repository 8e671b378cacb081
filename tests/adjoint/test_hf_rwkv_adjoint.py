"""Hugging Face RWKV (WKV) and xLSTM (mLSTM step loop) under the adjoint plans (issue 16 point 3).

Both keep their states max-shifted beside a running maximum; ``roll_driven_loops`` splits each
layer's loop into the maximum (run step by step) and one scan of the states, which the adjoint
plans shard. Checked in float64 with the models' float32 islands computed in float64
(``Float64Everywhere``): relative error <= 1e-10 against eager autograd of the same model, at an
odd length and at 150 steps (> 2 x 67: compiled at the adjoint's 67-step probe and
re-specialised). ``truncated_adjoint`` with ``window >= T`` is the same gradient.
xLSTM runs its step loop for sequences shorter than ``chunk_size`` (256 here).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.hf.test_hf_plans import _compare
from tests.hf.zoo import Float64Everywhere, build, inputs

OVERRIDES = {"rwkv": {}, "xlstm": {"chunk_size": 256}}
ADJOINT = {"shard_size": 8}
TRUNCATED = {"window": 1000, "shard_size": 8}  # window >= T: exact


def _exact(family: str, plan: str, options: dict[str, Any], T: int, model: Any = None) -> float:
    built, config = build(family, fp64_loss=False, **OVERRIDES[family])
    ids = inputs(config, batch=2, T=T)["input_ids"]
    err, cm = _compare(model if model is not None else built, config, plan, float64=True, options=options,
                       input_ids=ids)
    notes = [n for r in cm.passes if r.name == "roll_driven_loops" for n in r.notes]
    assert len(notes) == config.num_hidden_layers and all("packed into one scan" in n for n in notes), notes
    return err


@pytest.mark.parametrize("family, plan, options, T", [
    ("rwkv", "adjoint", ADJOINT, 37),
    pytest.param("rwkv", "adjoint", ADJOINT, 150, marks=pytest.mark.slow),
    pytest.param("rwkv", "truncated_adjoint", TRUNCATED, 37, marks=pytest.mark.slow),
    pytest.param("rwkv", "truncated_adjoint", TRUNCATED, 150, marks=pytest.mark.slow),
    pytest.param("xlstm", "adjoint", ADJOINT, 37, marks=pytest.mark.slow),
    pytest.param("xlstm", "adjoint", ADJOINT, 150, marks=pytest.mark.slow),
    pytest.param("xlstm", "truncated_adjoint", TRUNCATED, 37, marks=pytest.mark.slow),
], ids=["rwkv-adjoint-37", "rwkv-adjoint-150", "rwkv-truncated-37", "rwkv-truncated-150", "xlstm-adjoint-37",
        "xlstm-adjoint-150", "xlstm-truncated-37"])
def test_adjoint_plans_are_exact(family: str, plan: str, options: dict[str, Any], T: int) -> None:
    assert _exact(family, plan, options, T) <= 1e-10


def test_rwkv_with_large_keys_does_not_overflow() -> None:
    """Keys of magnitude ~1000: exp(k) overflows float64, so a scan of the unshifted numerator
    and denominator would give inf / inf; eager's max-shifted loop stays finite, and so does the
    split loop (it scans the same max-shifted states)."""
    model, config = build("rwkv", fp64_loss=False)
    keys: list[torch.Tensor] = []
    hooks = [b.attention.key.register_forward_hook(lambda m, i, o: keys.append(o.detach()))
             for b in model.rwkv.blocks]
    with torch.no_grad():
        for block in model.rwkv.blocks:
            block.attention.key.weight.mul_(1000.0)
        with Float64Everywhere():
            logits = model(input_ids=inputs(config, batch=2, T=21)["input_ids"]).logits
    for h in hooks:
        h.remove()
    assert max(float(k.max()) for k in keys) > 710 and bool(torch.isfinite(logits).all())
    assert _exact("rwkv", "adjoint", ADJOINT, 21, model=model) <= 1e-10
