"""Every plan end to end on a CUDA device: gradients against autograd on the same device.

The models, inputs and gradients live on the GPU; the region kernels resolve to Triton there
(``backend=None`` picks Triton for CUDA tensors), compiled for the device. float64, odd sizes,
exact plans within 1e-10 of eager autograd. These tests need a CUDA device: on a machine without
one the module is skipped (the same plans run on CPU in tests/adjoint, tests/chunked and
tests/kernels/test_plans_triton.py under the Triton interpreter).
"""

from __future__ import annotations

import copy

import pytest
import torch

import gradshard as gs
from gradshard.errors import CaptureError
from gradshard.examples import factories
from tests.bench_modules import load_bench

low_precision = load_bench("bench_low_precision")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
TOL = 1e-10


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float(a.norm())


def _grads(model: torch.nn.Module, run, inputs) -> dict[str, torch.Tensor]:
    out = run(*inputs)
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1)).to(out.device)
    (out * weight).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("factory,plan,options", [
    ("ssm", "none", {}),
    ("ssm", "adjoint", {"shard_size": 8}),
    ("ssm_scalar_decay", "adjoint", {"shard_size": 5}),
    ("ssm", "truncated_adjoint", {"window": 64}),  # window >= T: exact
    ("ssm", "seco", {"chunk_size": 8}),
    ("ssm", "spaco", {"chunk_size": 8, "budget": 5}),  # 37 steps in 5 chunks: every chunk kept
    ("llama", "seco", {"chunk_size": 8}),
    ("llama", "partial_update", {"num_slices": 2, "slice_index": 1}),
    ("hybrid", "adjoint", {"shard_size": 8}),
])
def test_plan_on_cuda_matches_autograd(factory: str, plan: str, options: dict) -> None:
    model, inputs = getattr(factories, factory)(dtype=torch.float64, seq_len=37, batch=3)
    model = model.to(CUDA)
    inputs = tuple(x.to(CUDA) for x in inputs)
    ref = _grads(model, model, inputs)
    model.zero_grad(set_to_none=True)
    twin = copy.deepcopy(model)
    cm = gs.compile(twin, plan=plan, **options)
    got = _grads(twin, cm, inputs)
    if plan == "partial_update":  # the trainable slice of each sliced weight, every other parameter whole
        full = cm.full_parameters()
        assert set(cm.parameter_slices()), "partial_update sliced nothing"
        for name, (original, (dim, start, stop)) in cm.parameter_slices().items():
            sliced = dict(cm.named_parameters())[name].grad
            assert _rel(sliced, ref[original].narrow(dim, start, stop - start)) <= TOL
        assert all(t.is_cuda for t in full.values())
        return
    assert set(got) == set(ref)
    worst = max(_rel(got[n], ref[n]) for n in ref)
    assert worst <= TOL, (plan, worst)
    kernels = " ".join(s.kernel for s in cm.program.stages if s.kernel)
    if plan in ("adjoint", "truncated_adjoint"):
        assert "triton:" in kernels and "torch:" not in kernels, kernels


def test_input_on_another_device_names_the_input_and_the_advice_works() -> None:
    model, (ids,) = factories.ssm(dtype=torch.float64, seq_len=19, batch=2)
    model = model.to(CUDA)
    cm = gs.compile(model, plan="adjoint", shard_size=8)
    with pytest.raises(CaptureError, match=r"input args\[0\] is on cpu.*parameters and buffers are on cuda"):
        cm(ids)  # ids stayed on the CPU
    out = cm(ids.to("cuda"))  # the advice
    assert out.is_cuda and torch.isfinite(out).all()


@pytest.mark.parametrize("model, plan, dtype", [("ssm", "adjoint", torch.bfloat16), ("ssm", "adjoint", torch.float16),
                                                ("llama", "seco", torch.bfloat16)],
                         ids=["ssm-adjoint-bf16", "ssm-adjoint-fp16", "llama-seco-bf16"])
def test_low_precision_on_cuda_is_as_good_as_eager(model: str, plan: str, dtype: torch.dtype) -> None:
    """bf16/fp16 at T=4096 on the GPU: the plan's gradient error against float64 is no worse than
    eager autograd's in the same dtype (the CPU test's contract and slack, tests/adjoint/test_low_precision.py)."""
    rows = low_precision.measure(model, dtype, 4096, [plan], d_model=32, device="cuda")
    print(rows)
    eager = rows[0]["error"]
    assert rows[0]["run"] == "eager" and eager < float("inf"), rows[0]
    for row in rows[1:]:
        assert not isinstance(row["error"], str) and row["error"] <= 1.5 * eager + 1e-4, (row, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seco_chunk_attention_keeps_no_probabilities_on_cuda(dtype: torch.dtype) -> None:
    """A chunk's queries against the prefix keys with grouped heads (gradshard/plans/chunked/attention.py):
    a fused kernel (memory-efficient in float32, flash in bfloat16), so what autograd keeps for the
    backward is O(keys), not the (heads x chunk x keys) probabilities the math kernel would keep;
    values and gradients as the explicit-mask reference in float64."""
    from gradshard.plans.chunked.attention import lower_right_attention, prefix_attention_reference

    g = torch.Generator(device=CUDA).manual_seed(0)
    B, H, Hkv, c, S, D = 1, 8, 2, 1024, 4096, 64  # kept by a fused kernel: q, repeated k and v, o, lse
    q = torch.randn(B, H, c, D, device=CUDA, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(B, Hkv, S, D, device=CUDA, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(B, Hkv, S, D, device=CUDA, dtype=dtype, generator=g).requires_grad_()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = lower_right_attention(q, k, v)
    probabilities = B * H * c * S * 4  # what the math kernel keeps (in float32) at least
    assert sum(saved) < probabilities / 4, (sum(saved), probabilities)  # fused: about 1/6 in float32
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = prefix_attention_reference(x64[0], x64[1][:, :, :S - c], x64[2][:, :, :S - c],
                                     x64[1][:, :, S - c:], x64[2][:, :, S - c:])
    cot = torch.randn(ref.shape, device=CUDA, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(out, (q, k, v), cot.to(dtype))
    want = torch.autograd.grad(ref, x64, cot)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(out.double(), ref.detach()) <= tol
    for a, b in zip(got, want):
        assert _rel(a.double(), b) <= tol
