"""qwen3_next (gated delta rule layers + full attention, MoE MLPs) under every plan.

HF's ``torch_chunk_gated_delta_rule`` works in blocks of a fixed 64 tokens (its
``chunk_size`` argument is not read from the config): the sequence is padded to a multiple
of 64, each block builds its UT transform by a lower unitriangular solve along the block's
steps, and a Python loop over blocks carries the state. ``rewrite_delta_rule_blocks``
(``passes/recurrence_delta.py``) proves that region equals the step recurrence
``S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``, ``o_t = S_tᵀ q_t`` and rewrites
it as one ``dense_linear_scan`` along time, so every plan runs it at any length, padded or not,
with shards and chunks of any size. T = 100 here: two blocks, padded by 28 inside transformers.

The layer computes in float32 inside a float64 model, and the gradients of ``dt_bias`` and
``A_log`` come out of a heavy cancellation, so the model-level exactness tests run model and
capture under ``zoo.Float64Everywhere`` (float32 islands computed in float64; nothing in
transformers is patched). Even in float64 those two gradients carry the blocked form's own
rounding: transformers' two implementations (``torch_chunk_gated_delta_rule`` and
``torch_recurrent_gated_delta_rule``) differ there by 0.7e-9 (T = 37), 3.2e-9 (T = 100),
1.8e-9 (T = 150), and gradshard's gradient differs from eager's by exactly that; every other
gradient matches to 1e-14. Against the step recurrence itself (the function-level tests
below, no cancellation) the rewrite is exact to 1e-15.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import gradshard as gs
from gradshard.capture import capture
from gradshard.passes.recurrence_delta import match_delta_rule_blocks

from .test_hf_plans import FLOAT64_REORDER, _run_cell, _weights
from .zoo import Float64Everywhere, build, inputs

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

T_BLOCKS = 100  # two 64-token blocks, the second padded by 28
PLANS = {
    "adjoint": {"shard_size": 8},
    "truncated_adjoint": {"window": 1000, "shard_size": 8},  # window >= T: exact
    "seco": {"chunk_size": 8},
    "spaco": {"chunk_size": 8, "budget": 1000},  # keeps every chunk: exact
}


def _model_error(plan: str, T: int, *, float64: bool, reference_float64: bool) -> tuple[float, gs.CompiledModule]:
    """Max relative error of logits and parameter gradients of ``gs.compile(model, plan)`` against
    eager on a copy, at length ``T`` (``float64``: gradshard under ``Float64Everywhere``;
    ``reference_float64``: eager under it)."""
    model, config = build("qwen3_next", attn="eager", fp64_loss=False)
    ref = copy.deepcopy(model)
    ids = inputs(config, batch=2, T=T)["input_ids"]
    cm = gs.compile(model, plan=plan, **PLANS[plan])

    def run(m: torch.nn.Module, f64: bool) -> torch.Tensor:
        with Float64Everywhere() if f64 else contextlib.nullcontext():
            out = m(input_ids=ids).logits
            (out * _weights(out)).sum().backward()
        return out.detach()

    got, want = run(cm, float64), run(ref, reference_float64)
    errs = [float((got - want).abs().max() / want.abs().max())]
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        if p.grad is not None:
            errs.append(float((q.grad - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-300)))
    return max(errs), cm


def _rewrite_notes(cm: gs.CompiledModule) -> list[str]:
    return [n for r in cm.passes if r.name == "rewrite_delta_rule_blocks" for n in r.notes]


# --------------------------------------------------------------------------- the rule itself


def _delta_inputs(B: int = 2, T: int = T_BLOCKS, H: int = 3, dk: int = 5, dv: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, T, H, dk, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen, dtype=torch.float64)
    g = -0.3 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _chunked(q, k, v, g, beta):  # type: ignore[no-untyped-def]
    return qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta)[0]


def _chunked_with_state(q, k, v, g, beta):  # type: ignore[no-untyped-def]
    o, state = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True)
    return o.sum() + state.sum()


@pytest.mark.parametrize("plan", ["adjoint", "seco"])
def test_blocked_rule_equals_transformers_step_recurrence(plan: str) -> None:
    """HF's blocked function (two blocks, padded) under the plan vs autograd through HF's own
    step-by-step ``torch_recurrent_gated_delta_rule``: outputs and all five input gradients."""
    xs = _delta_inputs()
    ys = [x.detach().clone().requires_grad_() for x in xs]
    cm = gs.compile(_chunked, plan=plan, **PLANS[plan])
    with Float64Everywhere():  # HF casts to float32 inside; compare in float64
        got = cm(*xs)
        want = qwen3_next.torch_recurrent_gated_delta_rule(*ys[:3], g=ys[3], beta=ys[4])[0]
        w = torch.linspace(0.5, 1.5, want.numel(), dtype=want.dtype).reshape(want.shape)
        (got * w).sum().backward()
        (want * w).sum().backward()
    assert float((got - want).detach().abs().max() / want.detach().abs().max()) <= 1e-12
    for x, y in zip(xs, ys):
        assert float((x.grad - y.grad).abs().max() / y.grad.abs().max()) <= 1e-12
    notes = _rewrite_notes(cm)
    assert len(notes) == 1 and "2 blocks of 64" in notes[0], notes


def _values(cap) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {p.name: v for p, v in zip(cap.gm.graph.find_nodes(op="placeholder"), cap.example_inputs)}


def test_region_whose_final_state_is_used_is_left_alone() -> None:
    """The final state leaves the region (a cache): not claimed as a readout-only recurrence."""
    with Float64Everywhere():
        cap = capture(_chunked_with_state, tuple(_delta_inputs()))
        assert match_delta_rule_blocks(cap.gm, _values(cap)) == []
        cap = capture(_chunked, tuple(_delta_inputs()))
        assert len(match_delta_rule_blocks(cap.gm, _values(cap))) == 1


def _blocked_gated_linear_attention(q, k, v, g, beta, L: int = 16):  # type: ignore[no-untyped-def]
    """Written like HF's blocked form (pad, blocks, loop carrying S, stack, slice), but without
    the delta correction: ``S_t = exp(g_t) S_{t-1} + β_t k_t v_tᵀ``. Same structure, other rule."""
    B, T, H, dk = q.shape
    pad = (-T) % L
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)) for x in (g, beta))
    n = (T + pad) // L
    q, k, v = (x.reshape(B, H, n, L, -1) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, L).cumsum(-1), beta.reshape(B, H, n, L)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    state, outs = q.new_zeros(B, H, dk, v.shape[-1]), []
    for i in range(n):
        gi = g[:, :, i]
        decay = (gi[..., :, None] - gi[..., None, :]).masked_fill(~causal, -math.inf).exp()
        kb = k[:, :, i] * beta[:, :, i, :, None]
        outs.append((q[:, :, i] * gi[..., None].exp()) @ state
                    + ((q[:, :, i] @ kb.transpose(-1, -2)) * decay) @ v[:, :, i])
        state = state * gi[..., -1, None, None].exp() \
            + (kb * (gi[..., -1:] - gi).exp()[..., None]).transpose(-1, -2) @ v[:, :, i]
    return torch.stack(outs, 2).reshape(B, H, -1, v.shape[-1])[:, :, :T].transpose(1, 2)


def test_a_blocked_region_computing_another_rule_is_not_rewritten() -> None:
    """The structure matches, the numeric proof does not: nothing is claimed."""
    cap = capture(_blocked_gated_linear_attention, tuple(_delta_inputs(T=40)))
    assert match_delta_rule_blocks(cap.gm, _values(cap)) == []


# --------------------------------------------------------------------------- the model


@pytest.mark.parametrize("plan", ["adjoint", "seco",
                                  # the same rewrite and runtime as adjoint / seco: kept out of the default time
                                  pytest.param("truncated_adjoint", marks=pytest.mark.slow),
                                  pytest.param("spaco", marks=pytest.mark.slow)])
def test_plans_are_exact_over_several_blocks(plan: str) -> None:
    """T = 100: two blocks, padding inside transformers, shards/chunks of 8 (not aligned to 64)."""
    err, cm = _model_error(plan, T_BLOCKS, float64=True, reference_float64=True)
    assert err <= FLOAT64_REORDER
    assert sum("chunked gated delta rule (2 blocks of 64" in n for n in _rewrite_notes(cm)) == 1


@pytest.mark.slow  # 12 s; the float64 cells above are the default suite's exactness check
def test_stock_float32_model_is_within_float32_of_the_float64_gradient() -> None:
    """The stock model (the layer in float32): gradshard's step recurrence in float32 lands
    within 5e-7 of the float64 gradient on every parameter, where eager's blocked float32 form
    is itself 0.85 (relative) away from it on ``A_log`` (0.76 on ``dt_bias``); gradshard differs
    from eager by eager's own float32 error there (0.63), and by float32 rounding (<= 2e-6) on
    every other parameter."""
    err, _ = _model_error("adjoint", T_BLOCKS, float64=False, reference_float64=True)
    assert err <= 1e-5


# --------------------------------------------------------------------------- within one block


@pytest.mark.slow
@pytest.mark.parametrize("attn, plan", [("eager", "seco"), ("sdpa", "seco"), ("sdpa", "spaco"), ("eager", "spaco"),
                                        ("eager", "adjoint"), ("eager", "truncated_adjoint")])
def test_plans_are_exact_within_one_block(attn: str, plan: str) -> None:
    """T = 37 < 64: one padded block (the zoo's matrix length)."""
    assert _run_cell("qwen3_next", attn, plan, float64=True) <= FLOAT64_REORDER


@pytest.mark.slow
def test_plans_are_exact_over_three_blocks() -> None:
    """T = 150: three blocks; adjoint shards of 8 and seco chunks of 8."""
    for plan in ("adjoint", "seco"):
        assert _model_error(plan, 150, float64=True, reference_float64=True)[0] <= FLOAT64_REORDER
