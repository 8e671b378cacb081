"""The chunk attention kernels agree with plain attention over the whole prefix (float64)."""

from __future__ import annotations

import warnings

import pytest
import torch

from gradshard.plans.chunked.attention import lower_right_attention, prefix_attention, prefix_attention_reference


def _qkv(B: int, H: int, Hkv: int, s: int, c: int, D: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    mk = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()  # noqa: E731
    return mk(B, H, c, D), mk(B, Hkv, s, D), mk(B, Hkv, s, D), mk(B, Hkv, c, D), mk(B, Hkv, c, D)


def _grads(out: torch.Tensor, ins: tuple[torch.Tensor, ...], cot: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, ins, cot))


@pytest.mark.parametrize("H,Hkv,s,c", [(4, 2, 7, 5), (3, 3, 11, 1), (6, 2, 0, 9)])
def test_lower_right_attention_is_the_masked_prefix_attention(H: int, Hkv: int, s: int, c: int) -> None:
    """The off-CPU form (one SDPA with ``causal_lower_right`` over repeated key heads), run here on the
    CPU: values and gradients of queries, past and current keys/values equal the explicit-mask reference."""
    q, kp, vp, kc, vc = _qkv(2, H, Hkv, s, c, 5)
    ins = (q, kp, vp, kc, vc)
    ref = prefix_attention_reference(q, kp if s else None, vp if s else None, kc, vc, scale=0.3)
    with warnings.catch_warnings():  # on the CPU torch warns that its fused kernels are CUDA-only
        warnings.simplefilter("ignore")
        out = lower_right_attention(q, torch.cat([kp, kc], -2), torch.cat([vp, vc], -2), scale=0.3)
    assert out.shape == ref.shape == (2, H, c, 5)
    assert torch.allclose(out, ref, rtol=0, atol=1e-13)
    cot = torch.randn_like(ref)
    wrt = ins if s else (q, kc, vc)
    for a, b in zip(_grads(out, wrt, cot), _grads(ref, wrt, cot)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("threads", [1, 4], ids=["grouped-heads-native", "grouped-heads-repeated"])
def test_cpu_flash_merge_is_the_masked_prefix_attention(threads: int) -> None:
    """The CPU form (a diagonal flash call and a prefix flash call merged by log-sum-exp); its backward
    with the grouped key heads as they are (as many (batch, key head) pairs as threads) and repeated
    (fewer pairs than threads)."""
    q, kp, vp, kc, vc = _qkv(1, 4, 2, 13, 6, 8)
    ins = (q, kp, vp, kc, vc)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = prefix_attention(*ins)
        ref = prefix_attention_reference(*ins)
        assert torch.allclose(out, ref, rtol=0, atol=1e-13)
        cot = torch.randn_like(ref)
        for a, b in zip(_grads(out, ins, cot), _grads(ref, ins, cot)):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)
    finally:
        torch.set_num_threads(before)
