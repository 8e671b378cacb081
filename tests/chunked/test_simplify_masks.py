"""simplify_attention_masks on masks we write ourselves: a causal position mask becomes
``is_causal``; a windowed, reversed or float mask is left alone; all stay exact under seco."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradshard as gs


class MaskedAttention(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        pos = torch.arange(x.shape[1])
        causal = pos[None, :] <= pos[:, None]
        mask = {"causal": causal,
                "window": causal & (pos[:, None] - pos[None, :] < 4),
                "float": torch.zeros(causal.shape, dtype=x.dtype).masked_fill(~causal, float("-inf"))}[self.kind]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1)


@pytest.mark.parametrize("kind, folded", [("causal", True), ("window", False), ("float", False)])
def test_only_a_boolean_causal_mask_is_folded(kind: str, folded: bool) -> None:
    torch.manual_seed(0)
    model = MaskedAttention(kind).double()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 11, 8, dtype=torch.float64)
    cm = gs.compile(model, plan="seco", chunk_size=4)
    got, want = cm(x), ref(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    got.sum().backward()
    want.sum().backward()
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-10)
    notes = [n for r in cm.passes if r.name == "simplify_attention_masks" for n in r.notes]
    assert any("is_causal=True" in n for n in notes) == folded, notes
