"""One probe serves every length and batch size on `transformers` models called with an
attention mask (issue 17).

transformers reads the attention mask input through ``mask[arange(B), arange(S)]`` and ands it
into the causal mask. The dims analysis sees that input's batch and time axes, the causality
check sees ``causal & padding`` as causal, and the re-specialiser rewrites batch and time sizes,
so a call at another length or batch is served from the graph captured at the 67-step probe.
Checked against eager autograd in float64, with a right-padded row.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gradshard as gs
from gradshard.plans.length_generic import PROBE_LENGTH

from .zoo import build, inputs


@pytest.mark.parametrize("family, plan", [("llama", "seco"), ("qwen3", "none")])
def test_a_padded_batch_is_served_at_new_lengths_and_batch_sizes(family: str, plan: str) -> None:
    model, config = build(family)
    ref = copy.deepcopy(model)
    data = inputs(config, batch=5, T=151, pad=7)  # the last row right-padded by 7 tokens
    cm = gs.compile(model, plan=plan, **({"chunk_size": 16} if plan == "seco" else {}))
    wrt = [p for p in model.parameters() if p.requires_grad]
    for B, T in [(3, 151), (5, 151), (2, 100)]:
        call = {k: v[:B, :T] for k, v in data.items()}
        loss, want = cm(**call).loss, ref(**call).loss
        assert abs(loss.item() - want.item()) <= 1e-12 * abs(want.item())
        got = torch.autograd.grad(loss, wrt)
        exp = torch.autograd.grad(want, list(ref.parameters()))
        for g, e in zip(got, exp):
            assert (g - e).abs().max() <= 1e-10 * max(e.abs().max().item(), 1e-30), (B, T)
        extras = cm.current.extras
        assert extras.get("respecialized_from") == PROBE_LENGTH and extras.get("batch", 3) == B, cm.explain()
    lg = cm.current.ctx.plan_state["length_generic"]
    assert lg.batch == 3 and len(lg.batch_inputs) == len(lg.time_inputs) == 3  # ids, labels, mask


# bamba (33 s; the same Mamba-2 mixer in a hybrid) runs in `make test-all`: the default suite stays under 15 min
@pytest.mark.parametrize("family", ["mamba2", pytest.param("bamba", marks=pytest.mark.slow)])
def test_mamba2_pads_to_its_chunk_and_is_served_from_a_symbolic_trace(family: str) -> None:
    """transformers' Mamba-2 mixer pads time to a multiple of its chunk and splits it into
    chunks, sizes its time facts cannot follow: at the second length the graph captured at the
    first is traced with symbolic sizes, and serves every length and batch size its guards allow
    without a capture (Bamba: attention layers too, whose mask subgraph the kept graph folded
    away). A length that is a multiple of the chunk breaks the model's own ``if pad_size > 0``
    (a guard from modeling_<family>.py): captured again, and explain() says so."""
    model, config = build(family)
    ref = copy.deepcopy(model)
    cm = gs.compile(model, plan="none")
    for B, T in [(2, 40), (2, 57), (3, 45), (2, 64)]:
        call = inputs(config, batch=B, T=T)
        loss, want = cm(**call).loss, ref(**call).loss
        got = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
        exp = torch.autograd.grad(want, [p for p in ref.parameters() if p.requires_grad])
        for g, e in zip(got, exp):
            assert (g - e).abs().max() <= 1e-10 * max(e.abs().max().item(), 1e-30), (B, T)
        text = cm.explain()
        if T in (57, 45):
            assert cm.current.extras.get("respecialized_from") == 40 and "captured again" not in text, text
            assert "from a capture with symbolic sizes at T=57, batch 2" in text, text
    assert "captured again" in text and f"modeling_{family}.py" in text and "is false at T=64, batch 2" in text, text
