"""FLOPs of gradshard's custom ops through torch.utils.flop_counter: counted by their formulas.

Each op is counted once, by the formula registered beside it in ``gradshard.ops`` (the aten ops inside its
implementation run below the counter and add nothing), by ``gs.measure`` and by a plain
``FlopCounterMode`` alike; a model built from them counts exactly the formula-predicted total.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import gradshard as gs
from gradshard.measure import StepFlopCounter, measure
from gradshard.ops.adjoint_shard import adjoint_shard_flops
from gradshard.ops.dense_scan import dense_linear_scan_flops
from gradshard.ops.lightning import lightning_attention_backward_flops, lightning_attention_flops
from gradshard.ops.linear_scan import linear_scan_flops

B, T, D = 3, 11, 5  # odd sizes: T is not a multiple of any chunk


def _mm(m: int, k: int, n: int) -> int:
    """torch's formula for an (m x k) @ (k x n) product."""
    return 2 * m * k * n


def test_every_custom_op_has_its_formula_in_torchs_registry() -> None:
    for name in ("linear_scan", "dense_linear_scan", "adjoint_shard", "lightning_attention",
                 "lightning_attention_backward"):
        assert getattr(torch.ops.gradshard, name) in flop_registry, name


def test_linear_scan_counts_its_formula_forward_and_backward() -> None:
    a = torch.rand(B, T, D, dtype=torch.float64, requires_grad=True)
    u = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    m = measure(lambda: gs.kernels.linear_scan(a, u).sum().backward(), repeat=0)
    # Forward: one scan. Backward: one reverse scan of the same shape (its VJP); the products
    # lam * h_{t-1} are pointwise, hence free.
    assert linear_scan_flops((B, T, D)) == 2 * B * T * D
    assert m.forward_flops == linear_scan_flops((B, T, D))
    assert m.backward_flops == linear_scan_flops((B, T, D))
    assert m.flops_by_op == (("gradshard.linear_scan", 2 * linear_scan_flops((B, T, D))),)
    # A plain FlopCounterMode counts the same: the formula lives in torch's registry.
    with FlopCounterMode(display=False) as plain:
        gs.kernels.linear_scan(a, u).sum().backward()
    assert plain.get_total_flops() == m.flops


def test_broadcast_coefficients_count_the_output() -> None:
    a = torch.rand(1, T, 1, dtype=torch.float64)  # shared over batch and state
    u = torch.randn(B, T, D, dtype=torch.float64)
    with StepFlopCounter() as fc:
        gs.kernels.linear_scan(a, u, reverse=True)
    assert fc.get_total_flops() == linear_scan_flops((B, T, D)) and fc.backward_flops == 0


def test_adjoint_shard_and_dense_scan_count_their_formulas() -> None:
    a, u, g = torch.rand(B, T, D), torch.randn(B, T, D), torch.randn(B, T, D)
    with StepFlopCounter() as fc:
        gs.kernels.adjoint_shard(a, u, g, torch.randn(B, D))
    assert fc.get_total_flops() == adjoint_shard_flops((B, T, D)) == 2 * linear_scan_flops((B, T, D))
    n, p = 4, 3
    A = torch.rand(B, T, n, n) / n
    v = torch.randn(B, T, n, p)
    with StepFlopCounter() as fc:
        torch.ops.gradshard.dense_linear_scan(A, v, None)
    assert fc.get_total_flops() == dense_linear_scan_flops((B, T, n, p), n) == 2 * B * T * n * p * n


@pytest.mark.parametrize("decay", ["none", "per_head", "per_step"])
def test_lightning_attention_counts_its_formulas(decay: str) -> None:
    h, dk, dv, chunk = 2, 4, 3, 4
    q = torch.randn(B, h, T, dk, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, h, T, dk, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, h, T, dv, dtype=torch.float64, requires_grad=True)
    d = {"none": None, "per_head": torch.rand(h, dtype=torch.float64) * 0.5 + 0.5,
         "per_step": torch.rand(B, h, T, dtype=torch.float64) * 0.5 + 0.5}[decay]

    def run() -> None:
        o, state = gs.kernels.lightning_attention(q, k, v, d, chunk_size=chunk)
        (o.sum() + state.sum()).backward()

    m = measure(run, repeat=0)
    fwd = lightning_attention_flops((B, h, T, dk), (B, h, T, dv), chunk)
    bwd = lightning_attention_backward_flops((B, h, T, dk), (B, h, T, dv), chunk, d is not None)
    # Per step: a block of `chunk` keys for the scores (q k^T, then times v) and two state products.
    assert fwd == B * h * T * (2 * chunk * (dk + dv) + 4 * dk * dv)
    assert (m.forward_flops, m.backward_flops) == (fwd, bwd)
    assert bwd > fwd


class _ScanAttention(torch.nn.Module):
    """x -> gates a = sigmoid(x W_a), inputs u = x W_u -> h = linear_scan(a, u) -> q, k, v = h W_*
    -> lightning attention with a per-head decay -> o W_o."""

    def __init__(self, d: int, heads: int, head_dim: int, chunk: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.chunk = heads, head_dim, chunk
        inner = heads * head_dim
        self.gate = torch.nn.Linear(d, d, bias=False)
        self.inp = torch.nn.Linear(d, d, bias=False)
        self.qkv = torch.nn.Linear(d, 3 * inner, bias=False)
        self.out = torch.nn.Linear(inner, d, bias=False)
        self.decay = torch.nn.Parameter(torch.full((heads,), 0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = gs.kernels.linear_scan(torch.sigmoid(self.gate(x)), self.inp(x))
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o, _ = gs.kernels.lightning_attention(q, k, v, self.decay, chunk_size=self.chunk)
        return self.out(o.transpose(1, 2).reshape(b, t, -1))


def test_model_with_gradshard_ops_counts_the_predicted_total() -> None:
    torch.manual_seed(0)
    d, heads, hd, chunk = 6, 2, 3, 4
    model = _ScanAttention(d, heads, hd, chunk).double()
    x = torch.randn(B, T, d, dtype=torch.float64)  # the input needs no gradient
    m = measure(gs.measure.step(lambda x: model(x).sum()), x, repeat=0)
    rows, inner = B * T, heads * hd
    qk_shape, v_shape = (B, heads, T, hd), (B, heads, T, hd)
    # Forward: four projections, the scan, the attention.
    forward = (_mm(rows, d, d) * 2 + _mm(rows, d, 3 * inner) + _mm(rows, inner, d)
               + linear_scan_flops((B, T, d)) + lightning_attention_flops(qk_shape, v_shape, chunk))
    # Backward: the weight gradient of every projection; the input gradient of those whose input
    # requires grad (not the two that read x); the reverse scan; the attention backward.
    backward = (_mm(d, rows, d) * 2 + _mm(3 * inner, rows, d) + _mm(inner, rows, d)
                + _mm(rows, 3 * inner, d) + _mm(rows, d, inner)
                + linear_scan_flops((B, T, d))
                + lightning_attention_backward_flops(qk_shape, v_shape, chunk, has_decay=True))
    assert (m.forward_flops, m.backward_flops) == (forward, backward)
    by_op = dict(m.flops_by_op)
    assert by_op["gradshard.linear_scan"] == 2 * linear_scan_flops((B, T, d))
    assert by_op["gradshard.lightning_attention"] == lightning_attention_flops(qk_shape, v_shape, chunk)
    with FlopCounterMode(display=False) as plain:
        model(x).sum().backward()
    assert plain.get_total_flops() == m.flops


def test_sdpa_formula_that_rejects_gqa_counts_key_value_broadcast_to_the_query_heads() -> None:
    """torch < 2.13's SDPA formulas assert on grouped-query shapes (seen on the GPU image's torch
    2.11: every GQA model refused under seco); the wrapper hands them key/value at the query's heads."""
    from gradshard.ops.aten_flops import count_gqa_broadcast

    def strict(grad_out, q, k, v, *args, out_val=None, **kwargs):  # a registry entry as torch 2.11 has it
        k_shape = k.shape if isinstance(k, torch.Tensor) else k
        assert q.shape[1] == k_shape[1], "sdpa_backward_flop_count: batch/heads mismatch among tensors"
        return q.shape[0] * q.shape[1] * q.shape[2] * k_shape[2]

    q, kv = torch.empty(2, 4, 5, 8), torch.empty(2, 2, 7, 8)
    with pytest.raises(AssertionError):
        strict(q, q, kv, kv)
    assert count_gqa_broadcast(strict, (1, 2, 3))(q, q, kv, kv) == 2 * 4 * 5 * 7
    # Equal heads pass through unchanged.
    assert count_gqa_broadcast(strict, (1, 2, 3))(q, q, q, q) == 2 * 4 * 5 * 5
