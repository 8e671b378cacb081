"""Partial-update runtime: sliced linears against full autograd (float64), FLOPs, metadata."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from gradshard.plans.partial_update.runtime import (
    PartialUpdateError,
    SlicedLinear,
    SliceLayout,
    attention_layouts,
    even_bounds,
    full_parameters,
    load_full_parameters,
    materialized_state_dict,
    mlp_in_layout,
    mlp_out_layout,
    parameter_slices,
    partial_linear,
    predicted_backward_flops_saved,
    slice_linears,
)

DT = torch.float64


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=bias)
        self.gate = nn.Linear(d, hidden, bias=bias)
        self.down = nn.Linear(hidden, d, bias=bias)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeluMLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Attention(nn.Module):
    """Causal GQA attention; q/k/v are head-major (head h = rows h*hd:(h+1)*hd)."""

    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, head_dim
        self.q = nn.Linear(d, heads * head_dim, bias=bias)
        self.k = nn.Linear(d, kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(d, kv_heads * head_dim, bias=bias)
        self.o = nn.Linear(heads * head_dim, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = (q @ k.transpose(-1, -2)) / self.hd**0.5
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        u = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return self.o(u)


def _seeded(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return model


def _mlp_layouts(prefix: str, hidden: int, n: int, k: int, gated: bool) -> dict[str, SliceLayout]:
    out = {f"{prefix}up": mlp_in_layout(hidden, n, k), f"{prefix}down": mlp_out_layout(hidden, n, k)}
    if gated:
        out[f"{prefix}gate"] = mlp_in_layout(hidden, n, k)
    return out


def _attn_layouts(heads: int, kv: int, hd: int, n: int, k: int) -> dict[str, SliceLayout]:
    q, kvl = attention_layouts(heads, kv, hd, n, k)
    return {"q": q, "k": kvl, "v": kvl}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _check_grads(model: nn.Module, layouts: dict[str, SliceLayout], x_shape) -> None:
    """Sliced grads == the matching entries of full autograd grads; input grads too."""
    ref = model
    sliced = slice_linears(copy.deepcopy(model), layouts)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(*x_shape, generator=g, dtype=DT)
    x_ref, x_sl = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_sl = ref(x_ref), sliced(x_sl)
    assert _rel(y_sl, y_ref) <= 1e-13
    w = torch.randn(y_ref.shape, generator=g, dtype=DT)
    (y_ref * w).sum().backward()
    (y_sl * w).sum().backward()
    assert _rel(x_sl.grad, x_ref.grad) <= 1e-10

    ref_params = dict(ref.named_parameters())
    # scale: some true gradients vanish (e.g. the k bias under softmax's shift invariance),
    # so errors are relative to the whole model's gradient norm when a tensor's is ~0
    scale = torch.stack([p.grad.norm() for p in ref.parameters()]).norm()
    slices = parameter_slices(sliced)
    assert slices, "nothing was sliced"
    for name, p in sliced.named_parameters():
        assert p.grad is not None, name
        if name in slices:
            orig, (dim, lo, hi) = slices[name]
            expect = ref_params[orig].grad.narrow(dim, lo, hi - lo)
        else:
            expect = ref_params[name].grad
        assert p.grad.shape == expect.shape, name
        err = (p.grad - expect).norm() / torch.maximum(expect.norm(), 1e-6 * scale)
        assert err <= 1e-10, name
    # frozen slices are buffers: no grad, no requires_grad, not parameters
    for name, buf in sliced.named_buffers():
        if ".frozen_" in f".{name}":
            assert not buf.requires_grad and buf.grad is None, name
    param_ids = {id(p) for p in sliced.parameters()}
    assert not any(id(b) in param_ids for b in sliced.buffers())


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_slice_grads_match_autograd(k: int, bias: bool) -> None:
    model = _seeded(SwiGLU(5, 11, bias=bias).to(DT), 1)
    _check_grads(model, _mlp_layouts("", 11, 3, k, gated=True), (3, 7, 5))


@pytest.mark.parametrize("n,k", [(2, 1), (4, 3)])
def test_gelu_mlp_slice_grads_match_autograd(n: int, k: int) -> None:
    model = _seeded(GeluMLP(6, 9).to(DT), 2)
    _check_grads(model, _mlp_layouts("", 9, n, k, gated=False), (1, 5, 6))


@pytest.mark.parametrize(
    "heads,kv,n,k", [(6, 3, 3, 1), (6, 3, 2, 0), (6, 3, 2, 1), (5, 5, 2, 1), (4, 2, 2, 1)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_attention_head_group_grads_match_autograd(heads: int, kv: int, n: int, k: int, bias: bool) -> None:
    model = _seeded(Attention(5, heads, kv, 2, bias).to(DT), 3)
    _check_grads(model, _attn_layouts(heads, kv, 2, n, k), (3, 6, 5))


def test_attention_layouts_align_heads_and_gqa_groups() -> None:
    q, kvl = attention_layouts(8, 4, 3, 2, 1)
    assert q.bounds == (0, 12, 24) and kvl.bounds == (0, 6, 12)
    q, kvl = attention_layouts(6, 3, 2, 2, 0)  # 3 kv heads over 2 slices: 2 + 1
    assert kvl.bounds == (0, 4, 6) and q.bounds == (0, 8, 12)
    # every q slice boundary is a whole head group of its kv slice
    for qb, kb in zip(q.bounds, kvl.bounds):
        assert qb == kb * 2
    with pytest.raises(PartialUpdateError, match="num_slices <= 1"):
        attention_layouts(8, 1, 4, 2, 0)  # MQA: one kv head cannot be split
    with pytest.raises(PartialUpdateError, match="not a multiple"):
        attention_layouts(6, 4, 2, 2, 0)


def test_even_bounds_and_layout_validation() -> None:
    assert even_bounds(10, 3) == (0, 4, 7, 10)
    assert even_bounds(12, 4, unit=3) == (0, 3, 6, 9, 12)
    with pytest.raises(PartialUpdateError, match="non-empty"):
        even_bounds(2, 3)
    with pytest.raises(PartialUpdateError, match="out of range"):
        SliceLayout(0, (0, 2, 4), 2)
    with pytest.raises(PartialUpdateError, match="strictly increase"):
        SliceLayout(1, (0, 2, 2, 4), 0)


def test_forward_matches_f_linear_all_layouts() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(9, 7, generator=g, dtype=DT)
    b = torch.randn(9, generator=g, dtype=DT)
    x = torch.randn(2, 3, 7, generator=g, dtype=DT)
    ref = F.linear(x, w, b)
    for dim, size in ((0, 9), (1, 7)):
        for n in (1, 2, 3):
            for k in range(n):
                layer = SlicedLinear(w, b, SliceLayout(dim, even_bounds(size, n), k))
                assert _rel(layer(x), ref) <= 1e-14
                assert torch.equal(layer.full_weight(), w) and torch.equal(layer.full_bias(), b)


def test_frozen_slice_requiring_grad_is_an_error() -> None:
    w = torch.randn(4, 3, dtype=DT)
    lay = SliceLayout(0, (0, 2, 4), 0)
    pieces = (w[:2].clone().requires_grad_(), w[2:].clone().requires_grad_())
    with pytest.raises(PartialUpdateError, match="frozen weight slice 1 requires grad"):
        partial_linear(torch.randn(2, 3, dtype=DT), pieces, lay)


def test_slice_linears_rejects_non_linear() -> None:
    with pytest.raises(PartialUpdateError, match="not an nn.Linear"):
        slice_linears(GeluMLP(4, 6), {"norm": mlp_in_layout(4, 2, 0)})


def test_optimizer_state_only_for_trainable_slices() -> None:
    model = slice_linears(_seeded(SwiGLU(6, 12).to(DT), 4), _mlp_layouts("", 12, 4, 2, gated=True))
    params = list(model.parameters())
    assert {n for n, _ in model.named_parameters()} == {"up.weight_slice", "gate.weight_slice", "down.weight_slice"}
    trainable = sum(p.numel() for p in params)
    assert trainable == 3 * 6 * 3  # a quarter of each 6x12 weight
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    frozen_before = {n: b.clone() for n, b in model.named_buffers()}
    model(torch.randn(2, 3, 6, dtype=DT)).square().sum().backward()
    opt.step()
    state_numel = sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    assert state_numel == 2 * trainable
    assert set(map(id, opt.state)) == set(map(id, params))
    for n, b in model.named_buffers():
        assert torch.equal(b, frozen_before[n]), f"frozen slice {n} changed"


@pytest.mark.parametrize("n,k", [(2, 0), (4, 1), (3, 2)])
def test_backward_flops_drop_by_predicted_amount(n: int, k: int) -> None:
    d, hidden, b, t = 16, 48, 2, 10
    base = _seeded(SwiGLU(d, hidden).to(DT), 5)
    sliced = slice_linears(copy.deepcopy(base), _mlp_layouts("", hidden, n, k, gated=True))
    x = torch.randn(b, t, d, dtype=DT, requires_grad=True)

    def flops(model):
        y = model(x)
        with FlopCounterMode(display=False) as fwd_counter:
            y2 = model(x)
        with FlopCounterMode(display=False) as counter:
            y2.sum().backward()
        del y
        return fwd_counter.get_total_flops(), counter.get_total_flops()

    fwd_full, bwd_full = flops(base)
    fwd_part, bwd_part = flops(sliced)
    assert fwd_full == fwd_part == 3 * 2 * b * t * d * hidden
    saved = predicted_backward_flops_saved(sliced, tokens=b * t)
    # 3 weights, each skipping the weight-gradient GEMMs of its n-1 frozen slices
    lo, hi = even_bounds(hidden, n)[k : k + 2]
    assert saved == 3 * 2 * b * t * d * (hidden - (hi - lo))
    assert bwd_full == 2 * fwd_full
    assert bwd_part == bwd_full - saved
    # input gradients still flow through every slice: backward >= forward
    assert bwd_part >= fwd_part


def test_materialize_and_load_full_parameters_round_trip() -> None:
    base = _seeded(GeluMLP(5, 7).to(DT), 6)
    sliced = slice_linears(copy.deepcopy(base), _mlp_layouts("", 7, 3, 1, gated=False))
    assert parameter_slices(sliced) == {
        "up.weight_slice": ("up.weight", (0, 3, 5)),
        "up.bias_slice": ("up.bias", (0, 3, 5)),
        "down.weight_slice": ("down.weight", (1, 3, 5)),
    }
    # the down bias is not split: an ordinary parameter, trained by every rank
    assert "down.bias" in dict(sliced.named_parameters())
    sd = materialized_state_dict(sliced)
    assert list(sd) == list(base.state_dict())
    for name, value in base.state_dict().items():
        assert torch.equal(sd[name], value), name
    fresh = GeluMLP(5, 7).to(DT)
    fresh.load_state_dict(sd)
    x = torch.randn(2, 4, 5, dtype=DT)
    assert _rel(fresh(x), base(x)) <= 1e-14

    new = {n: torch.randn_like(v) for n, v in full_parameters(sliced).items()}
    load_full_parameters(sliced, new)
    got = full_parameters(sliced)
    assert list(got) == list(dict(base.named_parameters()))
    for n in new:
        assert torch.equal(got[n], new[n]), n
    assert torch.equal(sliced.up.weight_slice, new["up.weight"][3:5])
    assert torch.equal(sliced.down.frozen_weight_0, new["down.weight"][:, :3])
    with pytest.raises(PartialUpdateError, match="not a \\(full\\) parameter"):
        load_full_parameters(sliced, {"up.weight_slice": new["up.weight"][3:5]})


def test_share_storage_slices_are_views_that_write_through() -> None:
    lin = nn.Linear(5, 8).to(DT)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    layer = SlicedLinear(lin.weight, lin.bias, SliceLayout(0, even_bounds(8, 2), 1), share_storage=True)
    assert layer.weight_slice.data_ptr() == lin.weight[4:].data_ptr()
    assert layer.frozen_weight_0.data_ptr() == lin.weight.data_ptr()
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(torch.randn(3, 5, dtype=DT)).sum().backward()
    opt.step()
    assert torch.equal(lin.weight[:4], w0[:4]) and not torch.equal(lin.weight[4:], w0[4:])
    assert torch.equal(lin.bias[:4], b0[:4]) and not torch.equal(lin.bias[4:], b0[4:])
    assert torch.equal(layer.full_weight(), lin.weight.detach())
    # input-split layout: column views of the same storage
    down = SlicedLinear(lin.weight, None, SliceLayout(1, even_bounds(5, 2), 0), share_storage=True)
    with torch.no_grad():
        down.weight_slice.mul_(0)
    assert torch.all(lin.weight[:, :3] == 0) and torch.all(lin.weight[:, 3:] != 0)
