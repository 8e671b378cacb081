"""MiniMax (Hugging Face ``MiniMaxForCausalLM``): its lightning-attention layers, a Python loop
over blocks of 16 steps, are recognised as one linear recurrence
(``passes/recurrence_lightning.py``), so every plan that carries a recurrence is exact.

The zoo's model computes its decay tables in float32 before the float64 cast (transformers
builds buffers first), so a recurrence with one ``λ`` per head matches them to float32
rounding: the cells hold at the family's 1e-5. With the tables recomputed in float64 the
same plans agree with eager to 1e-10, except where a plan rewrites the ``eager`` attention
layers (seco/spaco chunk them): eager attention takes its softmax in float32
(``softmax(..., dtype=torch.float32).to(query.dtype)``), a rounding the chunked softmax does not
repeat step for step, so those cells hold at float32's 1e-5 (measured: 4.9e-8).
"""

from __future__ import annotations

import pytest
import torch

from .test_hf_plans import _compare, _run_cell, _tolerance
from .zoo import build

PLANS = ("seco", "spaco", "adjoint", "truncated_adjoint")
CELLS = [(a, p) for a in ("sdpa", "eager") for p in PLANS]


def _float64_tables(model: torch.nn.Module) -> None:
    """Recompute every lightning layer's decay buffers in float64 (the model's own formulas)."""
    found = 0
    for m in model.modules():
        if hasattr(m, "decay_factors") and hasattr(m, "slope_rate"):
            q_decay, k_decay, mask = m.decay_factors(m.slope_rate)
            m.query_decay.copy_(q_decay)
            m.key_decay.copy_(k_decay)
            m.diagonal_decay.copy_(mask)
            found += 1
    assert found, "no lightning-attention layer in the model"


def _max_rel_err(plan: str, attn: str) -> float:
    model, config = build("minimax", attn=attn, fp64_loss=False)
    _float64_tables(model)
    err, cm = _compare(model, config, plan)
    notes = " ".join(n for r in cm.passes if r.name == "canonicalize_recurrences" for n in r.notes)
    assert "blockwise linear attention" in notes, notes
    return err


def test_adjoint_is_exact_with_float64_decay_tables() -> None:
    assert _max_rel_err("adjoint", "eager") <= 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("attn, plan", CELLS, ids=["-".join(c) for c in CELLS])
def test_zoo_cell_is_exact(attn: str, plan: str) -> None:
    assert _run_cell("minimax", attn, plan) <= _tolerance("minimax", attn)


@pytest.mark.slow
@pytest.mark.parametrize("attn, plan", CELLS, ids=["-".join(c) for c in CELLS])
def test_cell_is_exact_with_float64_decay_tables(attn: str, plan: str) -> None:
    float32_softmax_rewritten = attn == "eager" and plan in ("seco", "spaco")
    assert _max_rel_err(plan, attn) <= (1e-5 if float32_softmax_rewritten else 1e-10)
