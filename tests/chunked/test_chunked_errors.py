"""Models chunking cannot run exactly get an error naming the node, its line, why, and what to do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradshard as gs
from chunked_models import (BadBidirectional, BadDropout, BadFutureShift, BadGlobalNorm, BadLastToken,
                            BadReverseScan)


@pytest.mark.parametrize("model_cls, node, why", [
    (BadBidirectional, "scaled_dot_product_attention", "non-causal attention"),
    (BadFutureShift, "slice", "reads step(s) after"),
    (BadGlobalNorm, "sub", "reduction over the whole sequence"),
    (BadLastToken, "select", "selects one time step"),
    (BadReverseScan, "flip", "reverses the time axis"),
    (BadDropout, "dropout", "random numbers"),
])
def test_unsupported_models_raise_with_the_node_and_line(model_cls: type, node: str, why: str) -> None:
    model = model_cls()
    with pytest.raises(gs.UnsupportedGraphError) as info:
        gs.compile(model, plan="seco", chunk_size=3)(torch.randn(2, 9, 8))
    msg = str(info.value)
    assert f"node `{node}" in msg
    assert why in msg
    assert "chunked_models.py" in msg  # the user's source line
    assert "instead:" in msg


class _ExplicitNoMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cumsum(self.lin(x), 1)  # a time axis the analysis can see
        return torch.softmax(x @ x.transpose(1, 2), dim=-1) @ x


def test_explicit_attention_without_mask_is_non_causal() -> None:
    with pytest.raises(gs.UnsupportedGraphError, match="without a causal mask|reads future"):
        gs.compile(_ExplicitNoMask(), plan="seco", chunk_size=4)(torch.randn(1, 8, 8))


def test_dropout_in_eval_mode_is_fine() -> None:
    model = BadDropout().eval()
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    out = gs.compile(model, plan="seco", chunk_size=4)(x)
    assert torch.allclose(out, model(x))


def test_spaco_rejects_the_same_models() -> None:
    with pytest.raises(gs.UnsupportedGraphError, match="non-causal"):
        gs.compile(BadBidirectional(), plan="spaco", chunk_size=3, budget=2)(torch.randn(2, 9, 8))


def test_bad_options() -> None:
    with pytest.raises(gs.GradshardError, match="chunk_size"):
        gs.compile(nn.Linear(2, 2), plan="seco", chunk_size=0)
    with pytest.raises(gs.GradshardError, match="sampling"):
        gs.compile(nn.Linear(2, 2), plan="spaco", sampling="uniform")


def test_plan_none_still_reports_non_causal_attention_without_raising() -> None:
    cm = gs.compile(BadBidirectional(), plan="none")
    cm(torch.randn(2, 9, 8))
    att = [r for r in cm.regions if r.kind == "attention"]
    assert len(att) == 1 and att[0].options["causal"] is False


def test_max_over_time_in_the_loss_is_rejected() -> None:
    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = F.scaled_dot_product_attention(model(x).unsqueeze(1), x.unsqueeze(1), x.unsqueeze(1), is_causal=True)
        return y.amax()

    with pytest.raises(gs.UnsupportedGraphError, match="does not split into a sum over chunks"):
        gs.compile(loss_fn, plan="seco", chunk_size=3)(nn.Linear(8, 8), torch.randn(2, 9, 8))


def test_second_backward_and_bad_spaco_inputs_are_explained() -> None:
    from examples.factories import llama
    from gradshard.plans.chunked.runtime import force_selection

    model, (ids,) = llama(seq_len=9, batch=1)
    cm = gs.compile(model, plan="seco", chunk_size=4)
    loss = cm(ids).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once per forward"):
        loss.backward()
    sp = gs.compile(model, plan="spaco", chunk_size=4, budget=1)
    with pytest.raises(ValueError, match="out of range"), force_selection([5]):
        sp(ids).sum().backward()
    with pytest.raises(gs.GradshardError, match="max_compensation"):
        gs.compile(model, plan="spaco", chunk_size=4, max_compensation=-1.0)(ids)


class _PaddedSoftmaxAttention(nn.Module):
    """Hand-written attention with an additive ``-1e9`` mask: causal, plus a padding mask."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    @staticmethod
    def allowed(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``causal & keep``: (B, T, T), True where a query may read a key."""
        T = x.shape[1]
        return torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None] & keep[:, None, :].bool()

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / 8 ** 0.5 + (~self.allowed(x, keep)).to(x.dtype) * -1e9
        return self.out(torch.softmax(scores, dim=-1) @ v)


class _PaddedFloatMaskSDPA(_PaddedSoftmaxAttention):
    """SDPA given an additive float mask: ``where(causal & keep, bias, -1e9)`` with a learned
    per-key bias (ALiBi-like)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__(d)
        self.slope = nn.Parameter(torch.tensor(0.1))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        T = x.shape[1]
        allowed = self.allowed(x, keep)
        bias = self.slope * torch.arange(T, dtype=x.dtype, device=x.device)
        mask = torch.where(allowed, bias.expand(x.shape[0], T, T), -1e9)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("model_cls, node", [(_PaddedSoftmaxAttention, "softmax"),
                                             (_PaddedFloatMaskSDPA, "scaled_dot_product_attention")])
def test_a_row_with_every_key_masked_by_a_finite_value_is_refused(model_cls: type, node: str) -> None:
    """A left-padded row keeps no key of its prefix: with a finite mask value the softmax (or SDPA,
    given the float mask ``where(keep, x, -1e9)``, which the proof reads through to the boolean
    causal mask) weighs every key, future ones too, which a chunk cannot compute. Refused naming
    the node; the advice, right padding (every row keeps a key), is exact."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    left = torch.ones(2, 9)
    left[0, :3] = 0
    with pytest.raises(gs.UnsupportedGraphError, match="masks every key up to it") as info:
        gs.compile(model_cls().double(), plan="seco", chunk_size=3)(x, left)
    msg = str(info.value)
    assert f"node `{node}" in msg and "test_chunked_errors.py" in msg and "pad on the right" in msg
    right = torch.ones(2, 9)
    right[0, -3:] = 0
    model = model_cls().double()
    want = model(x, right)
    got = gs.compile(model, plan="seco", chunk_size=3)(x, right)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
