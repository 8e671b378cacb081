"""TransNormerLLM-style linear attention: block-wise lightning == quadratic == recurrence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from examples_testing import compare_models, rel_err, require_kernel
from examples.models.linear_attention import (
    LinearAttentionConfig,
    LinearAttentionLM,
    linear_attention_blockwise,
    linear_attention_naive,
    tnl_decay_rates,
)

TOL = 1e-12
SHAPES = [(b, t) for t in (1, 13, 37) for b in (1, 3)]


def tiny_config(**kw) -> LinearAttentionConfig:
    base = dict(d_model=16, n_layers=2, n_heads=2, glu_hidden=24, block_size=8)
    return LinearAttentionConfig(**{**base, **kw})


def build(config: LinearAttentionConfig, seed: int = 0) -> LinearAttentionLM:
    torch.manual_seed(seed)
    return LinearAttentionLM(config).double()


def twin(model: LinearAttentionLM, config: LinearAttentionConfig) -> LinearAttentionLM:
    other = LinearAttentionLM(config).double()
    other.load_state_dict(model.state_dict())
    return other


def recurrent_reference(q, k, v, log_decay, initial_state=None):
    """``kv_t = λ_t kv_{t-1} + k_t^T v_t``, ``o_t = q_t kv_t``, one step at a time."""
    bsz, heads, seq_len, dk = q.shape
    decay = torch.exp(log_decay).expand(bsz, heads, seq_len)
    kv = q.new_zeros(bsz, heads, dk, v.shape[-1]) if initial_state is None else initial_state
    outs = []
    for t in range(seq_len):
        kv = decay[:, :, t, None, None] * kv + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, None, :] @ kv).squeeze(-2))
    return torch.stack(outs, dim=2), kv


def random_qkv(bsz: int, seq_len: int, gated: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (bsz, 3, seq_len)
    q = torch.randn(bsz, 3, seq_len, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(bsz, 3, seq_len, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(bsz, 3, seq_len, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    if gated:
        log_decay = torch.log(0.6 + 0.4 * torch.rand(shape, generator=gen, dtype=torch.float64))
    else:
        log_decay = torch.log(torch.tensor([0.7, 0.95, 1.0], dtype=torch.float64))[None, :, None]
    return q, k, v, log_decay.requires_grad_()


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("batch,seq_len", SHAPES)
def test_blockwise_and_naive_match_recurrence(gated: bool, batch: int, seq_len: int) -> None:
    q, k, v, log_decay = random_qkv(batch, seq_len, gated)
    inputs = (q, k, v, log_decay)
    ref_o, ref_kv = recurrent_reference(q, k, v, log_decay)
    cot = torch.randn_like(ref_o)
    ref_grads = torch.autograd.grad((ref_o * cot).sum() + ref_kv.sum(), inputs)
    naive = linear_attention_naive(q, k, v, log_decay)
    assert rel_err(naive, ref_o) <= TOL
    for block_size in (1, 4, 8, 64):  # 13 and 37 are not multiples of 4 or 8
        o, kv = linear_attention_blockwise(q, k, v, log_decay, block_size)
        assert rel_err(o, ref_o) <= TOL and rel_err(kv, ref_kv) <= TOL
        grads = torch.autograd.grad((o * cot).sum() + kv.sum(), inputs)
        for g, gr in zip(grads, ref_grads):
            assert rel_err(g, gr) <= TOL


@pytest.mark.parametrize("gated", [False, True])
def test_blockwise_initial_state(gated: bool) -> None:
    q, k, v, log_decay = random_qkv(2, 13, gated, seed=1)
    kv0 = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    ref_o, ref_kv = recurrent_reference(q, k, v, log_decay, kv0)
    o, kv = linear_attention_blockwise(q, k, v, log_decay, 4, initial_state=kv0)
    assert rel_err(o, ref_o) <= TOL and rel_err(kv, ref_kv) <= TOL
    g = torch.autograd.grad(o.sum() + kv.sum(), kv0)[0]
    g_ref = torch.autograd.grad(ref_o.sum() + ref_kv.sum(), kv0)[0]
    assert rel_err(g, g_ref) <= TOL


@pytest.mark.parametrize("decay", ["constant", "gated"])
@pytest.mark.parametrize("batch,seq_len", SHAPES)
def test_model_blockwise_equals_naive(decay: str, batch: int, seq_len: int) -> None:
    config = tiny_config(decay=decay)
    blockwise = build(config)
    naive = twin(blockwise, dataclasses.replace(config, attn_impl="naive"))
    ids = torch.randint(0, 256, (batch, seq_len))
    assert blockwise(ids).shape == (batch, seq_len, 256)
    compare_models(blockwise, naive, ids, tol=TOL)


@pytest.mark.parametrize("norm,output_norm", [("rms", "rms"), ("srms", "none"), ("none", "srms")])
def test_norm_options(norm: str, output_norm: str) -> None:
    config = tiny_config(norm=norm, output_norm=output_norm, decay="gated")
    model = build(config)
    naive = twin(model, dataclasses.replace(config, attn_impl="naive"))
    compare_models(model, naive, torch.randint(0, 256, (3, 13)), tol=TOL)


@pytest.mark.parametrize("decay", ["constant", "gated"])
def test_gradshard_kernel_switch(decay: str) -> None:
    require_kernel("lightning_attention")
    config = tiny_config(decay=decay)
    naive = build(config, seed=3)
    kernel = twin(naive, dataclasses.replace(config, attn_impl="gradshard"))
    compare_models(kernel, naive, torch.randint(0, 256, (3, 37)), tol=1e-10)


@pytest.mark.parametrize("gated", [False, True])
def test_gradshard_kernel_function(gated: bool) -> None:
    lightning_attention = require_kernel("lightning_attention")
    q, k, v, log_decay = random_qkv(3, 13, gated, seed=2)
    decay = torch.exp(log_decay.detach())
    decay = decay.reshape(3) if not gated else decay
    kv0 = torch.randn(3, 3, 4, 5, dtype=torch.float64)
    o, kv = lightning_attention(q, k, v, decay, initial_state=kv0, chunk_size=4)
    ref_o, ref_kv = recurrent_reference(q, k, v, torch.log(decay).reshape(-1, 3, 1 if not gated else 13), kv0)
    assert rel_err(o, ref_o) <= 1e-10 and rel_err(kv, ref_kv) <= 1e-10


@pytest.mark.parametrize("decay", ["constant", "gated"])
def test_causal(decay: str) -> None:
    model = build(tiny_config(decay=decay))
    ids = torch.randint(0, 256, (2, 13))
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    a, b = model(ids), model(changed)
    assert torch.allclose(a[:, :9], b[:, :9], rtol=0, atol=1e-13)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_tnl_decay_rates() -> None:
    first = tnl_decay_rates(4, 0, 3)
    expected = torch.exp(-torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]) * (1 + 1e-5))
    assert torch.allclose(first, expected)
    last = tnl_decay_rates(4, 2, 3)
    assert ((last < 1) & (last > 1 - 1e-5)).all()  # the top layer barely decays
    assert ((tnl_decay_rates(6, 1, 4) > 0) & (tnl_decay_rates(6, 1, 4) < 1)).all()
    assert tnl_decay_rates(6, 0, 1).shape == (6,)


def test_every_parameter_gets_a_gradient() -> None:
    model = build(tiny_config(decay="gated", output_norm="rms", norm="rms"))
    model(torch.randint(0, 256, (2, 13))).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="attn_impl"):
        LinearAttentionConfig(attn_impl="flash")
    with pytest.raises(ValueError, match="n_heads"):
        LinearAttentionConfig(d_model=10, n_heads=4)
