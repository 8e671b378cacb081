"""Blockwise ("lightning") linear attention written as a Python loop over blocks is recognised
(``passes/recurrence_lightning.py``) and rewritten as one ``linear_scan``: every plan that
carries a linear recurrence is exact on it, and look-alikes are left alone.

The models here are our own (not Hugging Face's): float64 decay tables, odd shapes (T = 23 in
blocks of 6, 3 heads, dk = 5 != dv = 4), two layers, both q/k/v layouts ``(B, H, T, d)`` and
``(B, T, H, d)``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradshard as gs
from gradshard.capture import capture
from gradshard.errors import GradshardError
from gradshard.passes.recurrence_lightning import match_blocked_attention
from gradshard.passes.region_proof import proof_tolerance as _tolerance

from .helpers import assert_same_grads

T, BLOCK, HEADS, DK, DV, D = 23, 6, 3, 5, 4, 12


def _decay_tables(slope: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query decay λ^i, key decay λ^(L-i) (i = 1..L) and the mask λ^(i-j) (0 above the diagonal)."""
    i = torch.arange(1, block + 1, dtype=slope.dtype)
    q_decay = torch.exp(-slope * i[:, None])  # (H, L, 1)
    k_decay = torch.exp(-slope * (block - i[:, None]))
    diff = (i[:, None] - i[None, :])[None, None]
    mask = torch.exp(torch.where(diff >= 0, -slope[None] * diff, float("-inf")))  # (1, H, L, L)
    return q_decay, k_decay, mask


class BlockedLightning(nn.Module):
    """Lightning attention as MiniMax writes it: intra-block masked product, inter-block state."""

    def __init__(self, layout: str = "bhtd", causal: bool = True, learn_decay: bool = False,
                 keep_state: bool = False) -> None:
        super().__init__()
        self.layout, self.causal, self.keep_state = layout, causal, keep_state
        self.q = nn.Linear(D, HEADS * DK, bias=False)
        self.k = nn.Linear(D, HEADS * DK, bias=False)
        self.v = nn.Linear(D, HEADS * DV, bias=False)
        self.out = nn.Linear(HEADS * DV, D, bias=False)
        slope = torch.tensor([0.4, 0.13, 0.05], dtype=torch.float64)[:, None, None]  # (H, 1, 1)
        if learn_decay:
            self.slope = nn.Parameter(slope)
        else:
            self.register_buffer("slope", slope)
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = torch.nn.functional.silu(self.q(x)).view(b, t, HEADS, DK)
        k = torch.nn.functional.silu(self.k(x)).view(b, t, HEADS, DK)
        v = self.v(x).view(b, t, HEADS, DV)
        q_decay, k_decay, mask = _decay_tables(self.slope, BLOCK)
        if not self.causal:
            mask = torch.exp(-self.slope[None] * 0.5).expand(1, HEADS, BLOCK, BLOCK)
        o = self._bhtd(q, k, v, q_decay, k_decay, mask) if self.layout == "bhtd" else \
            self._bthd(q, k, v, q_decay, k_decay, mask)
        return self.out(o.reshape(b, t, HEADS * DV))

    def _bhtd(self, q, k, v, q_decay, k_decay, mask):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        t = q.shape[2]
        kv = torch.zeros(q.shape[0], HEADS, DK, DV, dtype=q.dtype)
        outs = []
        for start in range(0, t, BLOCK):
            end = min(start + BLOCK, t)
            n = end - start
            qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
            intra = ((qb @ kb.transpose(-1, -2)) * mask[:, :, :n, :n]) @ vb
            inter = (qb * q_decay[:, :n]) @ kv
            outs.append(intra + inter)
            kv = kv * torch.exp(-self.slope * n) + (kb * k_decay[:, -n:]).transpose(-1, -2) @ vb
        self._keep(kv)
        return torch.cat(outs, dim=-2).transpose(1, 2)

    def _bthd(self, q, k, v, q_decay, k_decay, mask):
        t = q.shape[1]
        kv = q.new_zeros(q.shape[0], HEADS, DK, DV)
        outs = []
        for start in range(0, t, BLOCK):
            end = min(start + BLOCK, t)
            n = end - start
            qb, kb, vb = q[:, start:end], k[:, start:end], v[:, start:end]
            scores = torch.einsum("bihd,bjhd->bhij", qb, kb) * mask[:, :, :n, :n]
            intra = torch.einsum("bhij,bjhe->bihe", scores, vb)
            inter = torch.einsum("bihd,bhde->bihe", qb * q_decay[:, :n].transpose(0, 1), kv)
            outs.append(intra + inter)
            kb_decayed = kb * k_decay[:, -n:].transpose(0, 1)
            kv = kv * torch.exp(-self.slope * n) + torch.einsum("bjhd,bjhe->bhde", kb_decayed, vb)
        self._keep(kv)
        return torch.cat(outs, dim=1)

    def _keep(self, kv: torch.Tensor) -> None:
        if self.keep_state:
            self.state = kv


class TwoLayers(nn.Module):
    """``x + attn(x)`` twice, then a position-wise head: two lightning regions in one graph."""

    def __init__(self, **kw) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BlockedLightning(**kw) for _ in range(2))
        self.head = nn.Linear(D, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
            if layer.keep_state:
                x = x + layer.state.sum()
        return self.head(torch.tanh(x))


def _model(**kw) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = TwoLayers(**kw).double()
    return model, torch.randn(3, T, D, dtype=torch.float64)


def _matches(model: nn.Module, x: torch.Tensor) -> list:
    cap = capture(model, (x,))
    values = {p.name: v for p, v in zip(cap.gm.graph.find_nodes(op="placeholder"), cap.example_inputs)}
    return match_blocked_attention(cap.gm, values)


PLANS = [("adjoint", {"shard_size": 5}), ("truncated_adjoint", {"window": 64, "shard_size": 5}),
         ("seco", {"chunk_size": 5}), ("spaco", {"chunk_size": 5, "budget": 100})]


def test_blockwise_form_is_exact_under_adjoint() -> None:
    model, x = _model()
    cm = assert_same_grads(model, (x,), plan="adjoint", shard_size=5)
    notes = " ".join(n for r in cm.passes if r.name == "canonicalize_recurrences" for n in r.notes)
    assert notes.count("blockwise linear attention") == 2, notes


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("plan, options", PLANS, ids=[p for p, _ in PLANS])
def test_every_plan_and_layout_is_exact(layout: str, plan: str, options: dict) -> None:
    model, x = _model(layout=layout)
    assert_same_grads(model, (x,), plan=plan, **options)


def test_layout_and_decay_are_found() -> None:
    """(B, T, H, d) slices along dim 1 and einsum products: q, k, v by role, λ off the mask."""
    model, x = _model(layout="bthd")
    found = _matches(model, x)
    assert len(found) == 2
    for r in found:
        assert r.layouts[0].perm == (0, 2, 1, 3) and r.out_layout.perm == (0, 2, 1, 3)
        assert r.decay.kind == "mask" and r.blocks == 4


@pytest.mark.parametrize("kw, why", [
    ({"causal": False}, "a block mask without the causal zeros reads later steps of the block"),
    ({"learn_decay": True}, "a trainable decay: reading λ at one node would drop its other gradient paths"),
    ({"keep_state": True}, "the final block state is used outside the loop"),
])
def test_look_alikes_are_not_claimed(kw: dict, why: str) -> None:
    model, x = _model(**kw)
    assert _matches(model, x) == [], why


@pytest.mark.slow
def test_unclaimed_block_loop_is_refused_with_a_named_node() -> None:
    model, x = _model(causal=False)
    with pytest.raises(GradshardError, match="node `"):
        gs.compile(model, plan="seco", chunk_size=5)(x)


def test_proof_tolerance_follows_the_constants_precision() -> None:
    f64 = torch.tensor([0.3, 0.7], dtype=torch.float64).exp()
    f32 = f64.float().double()
    assert _tolerance([f64, torch.zeros(3)]) == 1e-9
    assert _tolerance([f64, f32]) == pytest.approx(100 * torch.finfo(torch.float32).eps)
    assert _tolerance([f64.half().double()]) is None
