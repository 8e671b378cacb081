"""Unit tests of the time-locality analysis on graphs with the time axis moving around."""

from __future__ import annotations

import math

import pytest
import torch

from gradshard.analysis.locality import NoTimeAxisError, analyze_time_locality
from gradshard.capture import capture

from .models import (CausalConv, CausalSelfAttention, CumsumMixer, LoopRNN, NoTime, SDPABlock,
                     TimeFirst)

INF = math.inf


def _analyze(model, x, **kw):
    cap = capture(model, (x,))
    return cap, analyze_time_locality(cap.gm, example_inputs=cap.example_inputs, **kw)


def _out(cap):
    return next(iter(cap.gm.graph.find_nodes(op="output"))).args[0][0]


@pytest.mark.parametrize("mask", ["add", "masked_fill", "where"])
def test_explicit_causal_attention_reads_all_past(mask):
    cap, tl = _analyze(CausalSelfAttention(mask=mask), torch.randn(2, 7, 8))
    out = tl[_out(cap)]
    assert out.time_dims == (1,)
    assert out.reach.lo == -INF and out.reach.hi == 0
    scores = [n for n, i in tl.info.items() if len(i.time_dims) == 2]
    assert scores, "the T x T score matrix has two time dims"
    assert any(tl.info[n].causal_mask for n in scores)


def test_unmasked_attention_is_global():
    cap, tl = _analyze(CausalSelfAttention(mask="none"), torch.randn(2, 7, 8))
    assert tl[_out(cap)].reach.hi == INF


@pytest.mark.parametrize("causal, hi", [(True, 0), (False, INF)])
def test_sdpa_block(causal, hi):
    cap, tl = _analyze(SDPABlock(causal=causal), torch.randn(3, 5, 8))
    assert tl[_out(cap)].time_dims == (1,)
    assert tl[_out(cap)].reach.hi == hi
    # the head reshape moves time to dim 2 inside attention
    sdpa = [n for n in cap.gm.graph.nodes if "scaled_dot_product" in str(n.target)][0]
    assert tl[sdpa].time_dims == (2,)


def test_causal_conv1d_is_a_window_with_time_on_last_dim():
    cap, tl = _analyze(nn_seq(CausalConv(k=4), CumsumMixer()), torch.randn(2, 9, 8))
    conv = [n for n in cap.gm.graph.nodes if "conv1d" in str(n.target)][0]
    assert tl[conv].time_dims == (2,)  # (B, D, T) after the transpose
    assert tl[conv].local.lo == -3 and tl[conv].local.hi == 0
    sl = conv.next  # the [..., :T] slice keeps the window causal
    assert tl[sl].reach.lo == -3 and tl[sl].reach.hi == 0


def test_cumsum_with_time_axis_first_and_einsum():
    cap, tl = _analyze(TimeFirst(), torch.randn(6, 2, 8))
    assert tl.time_inputs == {next(iter(cap.gm.graph.find_nodes(op="placeholder"))).name: 0} or \
        list(tl.time_inputs.values()) == [0]
    cs = [n for n in cap.gm.graph.nodes if "cumsum" in str(n.target)][0]
    assert tl[cs].time_dims == (2,)
    out = tl[_out(cap)]
    assert out.time_dims == (0,) and out.reach.lo == -INF and out.reach.hi == 0


def test_unrolled_loop_steps_and_stack():
    cap, tl = _analyze(LoopRNN(), torch.randn(2, 5, 8))
    selects = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.select.int]
    assert [tl[s].abs_range[1] for s in selects] == sorted(tl[s].abs_range[1] for s in selects)
    assert all(tl[s].time_dims == () for s in selects)
    stack = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.stack.default][0]
    assert tl[stack].time_dims == (1,)
    assert tl[stack].reach.lo == -INF and tl[stack].reach.hi == 0
    assert any("loop" in e for es in tl.evidence.values() for e in es)


def test_pointwise_model_parts_are_pointwise():
    cap, tl = _analyze(SDPABlock(), torch.randn(2, 5, 8))
    lin = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.linear.default][0]
    assert tl[lin].reach.is_pointwise
    norm = [n for n in cap.gm.graph.nodes if "layer_norm" in str(n.target)][0]
    assert tl[norm].reach.is_pointwise  # normalises over features, not time


def test_reshape_merging_batch_and_time_keeps_time():
    class Merge(torch.nn.Module):
        def forward(self, x):
            B, T, D = x.shape
            y = x.reshape(B * T, D).relu().reshape(B, T, D)
            return y.cumsum(1)

    cap, tl = _analyze(Merge(), torch.randn(2, 5, 8))
    relu = [n for n in cap.gm.graph.nodes if "relu" in str(n.target)][0]
    assert tl[relu].time_dims == (0,)  # merged (B*T) dim carries time
    assert tl[_out(cap)].time_dims == (1,)


def test_mean_over_time_is_global():
    class Pool(torch.nn.Module):
        def forward(self, x):
            return x.cumsum(1).mean(dim=1)

    cap, tl = _analyze(Pool(), torch.randn(2, 5, 8))
    assert tl[_out(cap)].reach.hi == INF and tl[_out(cap)].time_dims == ()


def test_no_time_axis_is_a_clear_error():
    with pytest.raises(NoTimeAxisError, match="time_axis="):
        _analyze(NoTime(), torch.randn(4, 8))


def test_time_axis_hint():
    cap, tl = _analyze(NoTime(), torch.randn(4, 6, 8), time_axis=(0, 1))
    assert tl[_out(cap)].time_dims == (1,)
    assert tl[_out(cap)].reach.is_pointwise


def nn_seq(*mods):
    return torch.nn.Sequential(*mods)


@pytest.mark.parametrize("gated", [False, True])
def test_blockwise_linear_attention_is_causal(gated):
    """A python loop over blocks: slices move the origin; block states feed later blocks."""

    class Blockwise(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)
            self.gate = torch.nn.Linear(8, 1)
            self.register_buffer("log_decay", torch.tensor(-0.1))

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            g = torch.nn.functional.logsigmoid(self.gate(x))[..., 0] if gated else self.log_decay.expand(x.shape[:2])
            kv = q.new_zeros(x.shape[0], 8, 8)
            outs = []
            for s in range(0, x.shape[1], 4):
                e = min(s + 4, x.shape[1])
                qb, kb, vb, cum = q[:, s:e], k[:, s:e], v[:, s:e], torch.cumsum(g[:, s:e], 1)
                mask = torch.exp(cum[:, :, None] - cum[:, None, :]) * torch.ones(e - s, e - s).tril()
                outs.append((qb @ kb.transpose(1, 2) * mask) @ vb + (qb * cum.exp()[..., None]) @ kv)
                total = cum[:, -1:]
                kv = total.exp()[..., None] * kv + (kb * (total - cum).exp()[..., None]).transpose(1, 2) @ vb
            return torch.cat(outs, 1)

    cap, tl = _analyze(Blockwise(), torch.randn(2, 11, 8))
    out = tl[_out(cap)]
    assert out.time_dims == (1,) and out.reach.lo == -INF and out.reach.hi == 0
    assert any("token-token" in e or "chunked loop" in e for es in tl.evidence.values() for e in es)


def test_new_zeros_does_not_inherit_time_labels():
    """A state `q.new_zeros(B, dk)` must not tie time to dk when T == dk."""

    class State(torch.nn.Module):
        def forward(self, x):
            h = x.new_zeros(x.shape[0], x.shape[2])
            ys = []
            for t in range(x.shape[1]):
                h = 0.5 * h + x[:, t]
                ys.append(h)
            return torch.stack(ys, 1)

    cap, tl = _analyze(State(), torch.randn(2, 8, 8))
    nz = [n for n in cap.gm.graph.nodes if "new_zeros" in str(n.target)][0]
    assert tl[nz].time_dims == () and tl[nz].reach is None
    assert tl[_out(cap)].time_dims == (1,)


def test_flattened_rows_through_a_matmul_keep_batch_and_time_apart():
    """(B, T, D) -> (B*T, D) @ W -> (B, T, D'): the split gives time back to dim 1 only."""

    class Rows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            B, T, D = x.shape
            return torch.mm(x.reshape(B * T, D), self.w).reshape(B, T, D).cumsum(1)

    cap, tl = _analyze(Rows(), torch.randn(3, 5, 8))
    assert tl[_out(cap)].time_dims == (1,)
    classes = tl.dims
    ph = [n for n in cap.gm.graph.find_nodes(op="placeholder")][-1]
    b, t = classes.input_labels[ph.name][:2]
    assert classes.canon(b) != classes.canon(t)


class _MergedRowsAndVectors(torch.nn.Module):
    """Merged ``B*T`` rows through ``bmm`` and a matrix-vector product, then a cumsum over T."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8))
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.lin(x.flatten(0, 1)).view(b, t, d)
        rows = h.flatten(0, 1)
        y = torch.bmm(rows.unsqueeze(1), rows.unsqueeze(2)).view(b, t)  # (B*T, 1, 1) -> (B, T)
        return ((h @ self.w) + y).cumsum(1)  # (B, T, D) @ (D,) -> (B, T)


def test_batch_and_time_stay_apart_through_merged_rows_bmm_and_matvec():
    from gradshard.analysis.dims import analyze_dims

    cap, tl = _analyze(_MergedRowsAndVectors(), torch.randn(3, 11, 8))
    da = analyze_dims(cap.gm)
    x = [n for n in cap.gm.graph.nodes if n.op == "placeholder"][-1]
    b_cls, t_cls = ({da.canon(l) for l in ls} for ls in da.dims_of(x).dims[:2])
    assert b_cls.isdisjoint(t_cls)
    assert list(tl.time_inputs.values()) == [1] and tl.seq_len == 11


class PaddedCausalSDPA(torch.nn.Module):
    """Attention masked the way transformers builds a padded causal mask: ``causal & pad`` with
    the padding term read from the attention-mask input by ``mask[arange(B), arange(S)]``
    (``combine="or"``: a mask that keeps the union, which is not causal)."""

    def __init__(self, d: int = 8, combine: str = "and") -> None:
        super().__init__()
        self.qkv, self.combine = torch.nn.Linear(d, 3 * d), combine

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 1, d).permute(2, 0, 3, 1, 4)
        pos = torch.arange(T)
        causal = (pos[None, :] <= pos[:, None])[None, None]  # (1, 1, T, T)
        pad = attention_mask.bool()[torch.arange(B)[:, None, None, None], pos[None, None, None, :]]
        mask = causal & pad if self.combine == "and" else causal | pad
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(B, -1, T, T))


@pytest.mark.parametrize("combine, causal", [("and", True), ("or", False)])
def test_a_padding_mask_input_carries_batch_and_time_and_its_conjunction_with_a_causal_mask_is_causal(
        combine: str, causal: bool) -> None:
    """The attention-mask input is read by ``arange`` indices over its whole dims: it carries the
    batch along dim 0 and time along dim 1 (so a call at another length or batch can be served
    from the same graph). ``causal & pad`` keeps at most what the causal mask keeps; ``causal | pad``
    does not."""
    x, mask = torch.randn(3, 7, 8), torch.ones(3, 7)
    cap = capture(PaddedCausalSDPA(combine=combine), (x, mask))
    tl = analyze_time_locality(cap.gm, example_inputs=cap.example_inputs)
    phs = [p for p in cap.gm.graph.find_nodes(op="placeholder") if str(p.meta.get("gs_input_name")).startswith("input")]
    assert [tl.time_inputs.get(p.name) for p in phs] == [1, 1]
    batch = {tl.dims.canon(tl.dims.input_labels[p.name][0]) for p in phs}
    assert len(batch) == 1 and tl.time_class not in batch
    out = tl[_out(cap)]
    assert (out.reach.hi <= 0) == causal and (out.local.hi <= 0) == causal, out


class FloatMaskedSDPA(PaddedCausalSDPA):
    """SDPA given an additive float mask built from ``causal & pad`` (``kind`` says how)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 1, d).permute(2, 0, 3, 1, 4)
        pos = torch.arange(T)
        keep = (pos[None, :] <= pos[:, None])[None, None] & attention_mask.bool()[:, None, None, :]
        bias = 0.1 * pos.to(x.dtype).expand(B, 1, T, T)
        low = torch.finfo(x.dtype).min
        mask = {
            "where": lambda: torch.where(keep, bias, low),
            "where_swapped": lambda: torch.where(keep, low, bias),  # masks what the causal mask keeps
            "masked_fill_of_compare": lambda: bias.masked_fill(torch.where(keep, 0.0, low) < -1, low),
            "cast": lambda: keep.to(x.dtype),  # 1.0 / 0.0: weights, no mask
            "fill_not_low_enough": lambda: bias.masked_fill(~keep, -1.0),
        }[self.kind]()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kind, causal", [("where", True), ("where_swapped", False), ("masked_fill_of_compare", True),
                                          ("cast", False), ("fill_not_low_enough", False)])
def test_an_additive_float_mask_is_causal_when_it_masks_the_future_below_the_threshold(kind: str, causal: bool) -> None:
    """A float mask that reads the padding input is causal when every future entry is a constant
    below -1e4: ``where(keep, x, low)``, ``masked_fill(x, f < c, low)`` of an additive causal ``f``
    (falcon's ALiBi mask); a bool-to-float cast or a fill of -1 masks nothing."""
    x, mask = torch.randn(2, 7, 8), torch.ones(2, 7)
    cap = capture(FloatMaskedSDPA(kind), (x, mask))
    tl = analyze_time_locality(cap.gm, example_inputs=cap.example_inputs)
    out = tl[_out(cap)]
    assert (out.reach.hi <= 0) == causal, out
