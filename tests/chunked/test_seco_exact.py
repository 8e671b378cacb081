"""plan="seco" gives the exact gradient (float64, relative error <= 1e-10) on causal models."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import gradshard as gs
from chunk_testing import grads, rel_err
from chunked_models import ConvAttnLM, ScanRoPELM, TinyGPT
from examples.factories import hybrid, llama, llama_explicit_softmax, llama_hf, llama_loss

TOL = 1e-10


def _check_module(model: torch.nn.Module, inputs: tuple, chunk: int, wrt_inputs: bool = False) -> gs.CompiledModule:
    cm = gs.compile(model, plan="seco", chunk_size=chunk)
    out = cm(*inputs)
    ref = model(*inputs)
    assert (out - ref).abs().max() <= 1e-12 * max(1.0, ref.abs().max().item())
    cot = torch.randn_like(ref)
    wrt = [*model.parameters(), *(x for x in inputs if wrt_inputs and x.is_floating_point())]
    assert rel_err(grads(ref, wrt, cot), grads(out, wrt, cot)) <= TOL
    return cm


@pytest.mark.parametrize("batch", [1, 3])
def test_llama_sdpa_gqa_rope(batch: int) -> None:
    model, (ids,) = llama(seq_len=23, batch=batch, dtype=torch.float64)  # T=23: not a multiple of 5
    cm = _check_module(model, (ids,), chunk=5)
    region = cm.graph.seco_0
    assert region.program.num_chunks == 5
    kinds = {r.kind for r in cm.regions}
    assert "attention" in kinds
    att = [r for r in cm.regions if r.kind == "attention"]
    assert all(r.options["n_rep"] == 2 and r.options["rope"] and r.options["causal"] for r in att)
    # the KV cache is the pre-repeat keys/values (2 kv heads), read by flash attention
    for r in att:
        assert r.options["k_cache"] in region.program.cache_points
        assert tuple(region.program.nodes[r.options["k_cache"]].meta["val"].shape)[1] == 2


def test_llama_explicit_softmax_repeat_interleave() -> None:
    model, (ids,) = llama_explicit_softmax(seq_len=19, batch=2, kv_repeat="repeat_interleave",
                                           dtype=torch.float64)
    cm = _check_module(model, (ids,), chunk=4)
    att = [r for r in cm.regions if r.kind == "attention"]
    assert len(att) == 2 and all(r.options["form"] == "explicit" for r in att)


def test_llama_mha_without_gqa() -> None:
    model, (ids,) = llama_explicit_softmax(seq_len=13, batch=2, n_kv_heads=4, dtype=torch.float64)
    _check_module(model, (ids,), chunk=3)


def test_hybrid_ssm_attention() -> None:
    model, (ids,) = hybrid(seq_len=21, batch=2, dtype=torch.float64)
    cm = _check_module(model, (ids,), chunk=4)
    reasons = {s.reason for s in cm.graph.seco_0.program.cache_points.values()}
    assert "scan carry" in reasons  # the log-space cumsum scans carry their state across chunks
    assert any(r.kind == "linear_recurrence" for r in cm.regions)


def test_user_gpt_learned_positions_bool_mask_layernorm() -> None:
    torch.manual_seed(0)
    model = TinyGPT().double()
    _check_module(model, (torch.randint(0, 50, (3, 21)),), chunk=4)


def test_user_conv_running_mean_float_mask() -> None:
    torch.manual_seed(1)
    model = ConvAttnLM().double()
    cm = _check_module(model, (torch.randint(0, 40, (2, 19)),), chunk=4)
    specs = cm.graph.seco_0.program.cache_points.values()
    assert any(s.retention == 2 for s in specs)  # kernel-3 causal conv after attention: 2-step tail


def test_user_linear_scan_cached_rope_token_shift_input_grads() -> None:
    torch.manual_seed(2)
    model = ScanRoPELM().double()
    x = torch.randn(3, 17, 16, dtype=torch.float64, requires_grad=True)
    _check_module(model, (x,), chunk=4, wrt_inputs=True)


@pytest.mark.parametrize("chunk", [1, 7, 50])
def test_chunk_sizes_one_exact_and_larger_than_t(chunk: int) -> None:
    model, (ids,) = llama(seq_len=7, batch=2, dtype=torch.float64)
    _check_module(model, (ids,), chunk=chunk)


def test_loss_inside_mean_cross_entropy_with_ignore_index() -> None:
    fn, (model, (ids, labels)) = llama_loss(seq_len=23, batch=3, dtype=torch.float64)
    labels = labels.clone()
    labels[0, 3:9] = -100
    cm = gs.compile(fn, plan="seco", chunk_size=5)
    loss = cm(model, (ids, labels))
    ref = fn(model, (ids, labels))
    assert abs(loss.item() - ref.item()) <= 1e-12
    ps = list(model.parameters())
    assert rel_err(grads(ref, ps), grads(loss, ps)) <= TOL
    # the region returns only the loss: logits are never assembled over the full sequence
    outs = cm.graph.seco_0.program.outputs
    assert [o.kind for o in outs] == ["reduction"]


def test_hf_style_output_with_shifted_labels() -> None:
    model, (ids, pos, labels) = llama_hf(seq_len=23, batch=3, dtype=torch.float64)
    labels = labels.clone()
    labels[1, :5] = -100
    cm = gs.compile(model, plan="seco", chunk_size=4)
    out, ref = cm(ids, pos, labels), model(ids, pos, labels)
    assert type(out).__name__ == "CausalLMOutput"
    assert (out.logits - ref.logits).abs().max() <= 1e-12
    ps = list(model.parameters())
    assert rel_err(grads(ref.loss, ps), grads(out.loss, ps)) <= TOL


def test_loss_arithmetic_after_the_reductions_stays_outside() -> None:
    model, (ids,) = llama(seq_len=17, batch=2, dtype=torch.float64)
    labels = torch.randint(0, 256, ids.shape)

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = m(ids)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        z = (logits**2).mean()
        return 0.5 * ce / ids.numel() + 1e-3 * z + logits[..., 0].sum() * 1e-2

    cm = gs.compile(loss_fn, plan="seco", chunk_size=4)
    loss, ref = cm(model, ids, labels), loss_fn(model, ids, labels)
    assert abs(loss.item() - ref.item()) <= 1e-12 * abs(ref.item())
    ps = list(model.parameters())
    assert rel_err(grads(ref, ps), grads(loss, ps)) <= TOL
    assert sorted(o.reduction.kind for o in cm.graph.seco_0.program.outputs) == ["mean", "sum", "sum"]


def test_float32_close_and_repeated_calls_accumulate() -> None:
    model, (ids,) = llama(seq_len=20, batch=2)
    cm = gs.compile(model, plan="seco", chunk_size=6)
    for _ in range(2):
        cm(ids).square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for _ in range(2):
        model(ids).square().mean().backward()
    assert rel_err([p.grad for p in model.parameters()], got) <= 1e-5
    assert cm.graph.seco_0.stats["forward_calls"] == 2


@pytest.mark.parametrize("factory, overrides", [
    ("hybrid", {"ssm_loop": True}),  # per-step Python loop, rolled into linear_scan by roll_loops
    ("ssm_scalar_decay", {}),        # causal conv1d + learned h0 folded in with cat along time
    ("ssm_gradshard_scan", {}),      # gradshard.kernels.linear_scan
    ("ssm_associative_scan", {}),    # associative_scan tree, canonicalised into one scan op
    ("ssm_dense", {}),               # dense transition A_t @ h (dense_linear_scan after rolling)
])
def test_recurrent_variants(factory: str, overrides: dict) -> None:
    import examples.factories as factories

    model, (ids,) = getattr(factories, factory)(seq_len=13, batch=2, dtype=torch.float64, **overrides)
    _check_module(model, (ids,), chunk=4)


class _WithUnusedParameter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(torch.tanh(self.used(x)), 1)


@pytest.mark.parametrize("plan", ["seco", "spaco"])
def test_unused_parameter_keeps_grad_none_and_the_rest_is_exact(plan: str) -> None:
    """A parameter no node reads has no chunk rule: it gets no gradient (as in eager), the others
    are exact (it used to raise KeyError in the backward)."""
    torch.manual_seed(0)
    model = _WithUnusedParameter().double()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 11, 4, dtype=torch.float64)
    opts = {"chunk_size": 4} if plan == "seco" else {"chunk_size": 4, "budget": 100}
    gs.compile(model, plan=plan, **opts)(x).sum().backward()
    ref(x).sum().backward()
    assert model.unused.weight.grad is None and ref.unused.weight.grad is None
    for p, q in zip(model.used.parameters(), ref.used.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12)


class _MaskPositions(torch.nn.Module):
    """Positions from an integer cumsum of the mask (OPT's learned positions, falcon's and
    bloom's ALiBi): an integer value seco keeps in its cache, read by later chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(64, 16), torch.nn.Embedding(64, 16)
        self.out = torch.nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids > 0).long()
        positions = (mask.cumsum(-1) - 1).clamp_min(0) * mask
        return self.out(self.emb(ids) + self.pos(positions))


def test_integer_cache_points_take_no_gradient() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 37))
    ids[0, :4] = 0  # left padding
    _check_module(_MaskPositions().double(), (ids,), chunk=8)


class _SinkAttention(torch.nn.Module):
    """Attention with a learned sink logit per head appended to each row's keys (gpt-oss,
    StreamingLLM): the key axis is the steps plus one position that is no step. ``first=True``
    prepends it instead."""

    def __init__(self, d: int = 12, heads: int = 3, first: bool = False, flat: bool = False,
                 sink_value: str = "") -> None:
        super().__init__()
        self.heads, self.first, self.flat, self.sink_value = heads, first, flat, sink_value
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.sinks = torch.nn.Parameter(torch.randn(heads))
        self.sink_v = torch.nn.Parameter(torch.randn(heads, 1, d // heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        mask = torch.full((T, T), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + mask
        sink = self.sinks.view(1, -1, 1, 1).expand(B, -1, T, 1)
        logits = torch.cat([sink, scores] if self.first else [scores, sink], dim=-1)
        if self.flat:  # (B*H, T, T+1): the keys and their tail stay one dim through the view
            logits = logits.flatten(0, 1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)
        if self.sink_value:  # the sink keeps its weight and has a learned value row, or a zero row padded on
            v = (torch.cat([v, self.sink_v.expand(B, -1, -1, -1)], dim=-2) if self.sink_value == "row"
                 else F.pad(v, (0, 0, 0, 1)))  # as one more step: no tail
            return self.out((probs @ v).transpose(1, 2).reshape(B, T, d))
        probs = probs[..., 1:] if self.first else probs[..., :-1]  # the sink's weight is dropped
        probs = probs.view(B, self.heads, T, T)
        return self.out((probs @ v).transpose(1, 2).reshape(B, T, d))


@pytest.mark.parametrize("plan, options", [("seco", {}), ("spaco", {}), ("seco", {"flat": True}),
                                           ("seco", {"sink_value": "row"})])
def test_attention_sinks_after_the_keys_are_exact(plan: str, options: dict) -> None:
    """The sink column is the key axis's tail: every chunk's rows read their causal prefix of keys
    and the sink; the slice that drops it leaves the prefix, and a product with values that carry
    a sink row of their own contracts both tails."""
    torch.manual_seed(0)
    model = _SinkAttention(**options).double()
    x = torch.randn(2, 11, 12, dtype=torch.float64)
    options = {"chunk_size": 4} if plan == "seco" else {"chunk_size": 4, "budget": 1000}
    cm = gs.compile(model, plan=plan, **options)
    out, ref = cm(x), model(x)
    assert (out - ref).abs().max() <= 1e-12
    cot = torch.randn_like(ref)
    wrt = [*model.parameters(), x.requires_grad_()]
    assert rel_err(grads(ref, wrt, cot), grads(out, wrt, cot)) <= TOL


def test_a_sink_before_the_keys_is_refused_naming_the_cat() -> None:
    """A position without time before the steps would shift every key; refused at the ``cat``
    with the order that works (the test above)."""
    model = _SinkAttention(first=True).double()
    with pytest.raises(gs.UnsupportedGraphError, match="before pieces that do") as info:
        gs.compile(model, plan="seco", chunk_size=4)(torch.randn(2, 11, 12, dtype=torch.float64))
    assert "node `cat" in str(info.value) and "test_seco_exact.py" in str(info.value)
    assert "after the keys" in str(info.value)
    with pytest.raises(gs.UnsupportedGraphError, match="only one operand has") as info:
        gs.compile(_SinkAttention(sink_value="pad").double(), plan="seco", chunk_size=4)(
            torch.randn(2, 11, 12, dtype=torch.float64))
    assert "node `matmul" in str(info.value) or "node `bmm" in str(info.value)
