"""Under seco, when the module returns its loss, the forward runs the last chunk with grad and
the backward starts from that graph instead of recomputing it: one chunk's forward fewer per
step, no higher peak, exact. A module returning logits keeps nothing (the caller's loss over
them would be allocated next to the held graph).

Measured against spaco with a budget one short of every chunk but a selection forced to keep
them all (:func:`force_selection`): the same chunked program and work, every chunk recomputed in
the backward. At a budget of every chunk spaco keeps the last chunk as seco does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradshard as gs
from chunk_testing import grads, rel_err
from gradshard.plans.chunked.runtime import force_selection
from examples.factories import llama, ssm


class WithLoss(nn.Module):
    """``model``'s next-token cross-entropy, inside the module."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _pair(model: nn.Module) -> tuple[gs.CompiledModule, gs.CompiledModule]:
    """seco, and spaco recomputing every one of the 3 chunks (forced; factor 3/2 on the cotangents)."""
    return (gs.compile(model, plan="seco", chunk_size=16),
            gs.compile(model, plan="spaco", chunk_size=16, budget=2, sampling="fixed"))


@pytest.mark.parametrize("factory", [llama, ssm])
def test_the_kept_chunk_saves_its_recompute_at_the_same_peak(factory) -> None:
    torch.manual_seed(0)
    model, (ids,) = factory(seq_len=48, batch=1)
    labels = torch.roll(ids, -1, 1)
    model = WithLoss(model)
    seco, every = _pair(model)
    with force_selection(range(3)):
        for cm in (seco, every):
            cm(ids, labels).backward()  # compile
        m_seco = gs.measure(lambda: seco(ids, labels).backward())
        m_every = gs.measure(lambda: every(ids, labels).backward())
    region = seco.graph.seco_0
    assert region.keeps_last_chunk and not every.graph.spaco_0.keeps_last_chunk
    assert region.program.num_chunks == 3
    assert [s.name for s in seco.program.stages if s.kind == "recompute_chunk"][0] == "seco_0:vjp_chunk_2"
    # the forward FLOPs of one chunk fewer (the last; under attention the longest-reaching one)
    saved = m_every.flops - m_seco.flops
    assert 0.25 * m_every.forward_flops <= saved <= 0.7 * m_every.forward_flops, (m_seco.flops, m_every.flops)
    assert m_seco.peak_bytes <= 1.02 * m_every.peak_bytes + 4096, (m_seco.peak_bytes, m_every.peak_bytes)


def test_a_module_returning_logits_keeps_no_chunk() -> None:
    model, (ids,) = ssm(seq_len=48, batch=1)
    seco, every = _pair(model)
    with force_selection(range(3)):
        for cm in (seco, every):
            cm(ids).square().mean().backward()
        m_seco = gs.measure(lambda: seco(ids).square().mean().backward())
        m_every = gs.measure(lambda: every(ids).square().mean().backward())
    assert not seco.graph.seco_0.keeps_last_chunk
    assert m_seco.flops == m_every.flops and m_seco.peak_bytes <= 1.02 * m_every.peak_bytes + 4096


def test_kept_chunk_gradient_is_exact_and_the_backward_runs_once() -> None:
    model, (ids,) = llama(seq_len=19, batch=2, dtype=torch.float64)
    labels = torch.roll(ids, -1, 1)
    model = WithLoss(model)
    cm = gs.compile(model, plan="seco", chunk_size=7)
    out, ref = cm(ids, labels), model(ids, labels)
    assert cm.graph.seco_0.keeps_last_chunk
    params = list(model.parameters())
    cot = torch.tensor(1.7, dtype=torch.float64)
    assert rel_err(grads(ref, params, cot), grads(out, params, cot)) <= 1e-10
    with pytest.raises(RuntimeError, match="runs once per forward"):
        out = cm(ids, labels)
        out.backward(retain_graph=True)
        out.backward()


def test_a_call_under_no_grad_keeps_no_graph() -> None:
    """``needs_input_grad`` is true under ``torch.no_grad()`` too: the caller's grad mode decides."""
    model, (ids,) = llama(seq_len=48, batch=1)
    labels = torch.roll(ids, -1, 1)
    model = WithLoss(model)
    seco = gs.compile(model, plan="seco", chunk_size=16)
    seco(ids, labels).backward()
    with torch.no_grad():
        m = gs.measure(lambda: seco(ids, labels))
    assert m.saved_bytes == 0
    held: list[torch.Tensor] = []
    m = gs.measure(lambda: held.append(seco(ids, labels)))  # with grad: the last chunk's graph is kept
    assert m.saved_bytes > 0
    held.pop().backward()


def test_spaco_at_a_budget_of_every_chunk_keeps_the_last_one() -> None:
    model, (ids,) = ssm(seq_len=48, batch=1, dtype=torch.float64)
    labels = torch.roll(ids, -1, 1)
    model = WithLoss(model)
    cm = gs.compile(model, plan="spaco", chunk_size=16, budget=3)
    out, ref = cm(ids, labels), model(ids, labels)
    assert cm.graph.spaco_0.keeps_last_chunk
    params = list(model.parameters())
    cot = torch.tensor(0.3, dtype=torch.float64)
    assert rel_err(grads(ref, params, cot), grads(out, params, cot)) <= 1e-10
