"""Hybrid SSM / attention stack: runs at odd shapes, loop and vectorized SSM layers agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from examples_testing import compare_models
from examples.models.hybrid import HybridConfig, HybridLM
from examples.models.linear_attention import LinearAttentionConfig
from examples.models.llama import LlamaConfig
from examples.models.ssm import SSMConfig

SHAPES = [(b, t) for t in (1, 13, 37) for b in (1, 3)]


def tiny_config(**kw) -> HybridConfig:
    base = dict(
        d_model=16,
        layers=("ssm", "attention", "linear_attention", "ssm"),
        ssm=SSMConfig(d_state=4, conv_kernel=4, learn_initial_state=True),
        attention=LlamaConfig(n_heads=4, n_kv_heads=2, intermediate_size=24, attention="explicit"),
        linear_attention=LinearAttentionConfig(n_heads=2, glu_hidden=24, block_size=8, decay="gated"),
    )
    return HybridConfig(**{**base, **kw})


@pytest.mark.parametrize("batch,seq_len", SHAPES)
def test_loop_and_vectorized_hybrids_agree(batch: int, seq_len: int) -> None:
    config = tiny_config()
    torch.manual_seed(0)
    vec = HybridLM(config).double()
    loop = HybridLM(dataclasses.replace(config, ssm_loop=True)).double()
    loop.load_state_dict(vec.state_dict())
    ids = torch.randint(0, 256, (batch, seq_len))
    assert vec(ids).shape == (batch, seq_len, 256)
    compare_models(vec, loop, ids, tol=1e-12)


def test_layer_kinds_and_shared_width() -> None:
    model = HybridLM(tiny_config(layers=("ssm", "attention", "ssm", "attention")))
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["SelectiveSSMBlock", "LlamaDecoderLayer", "SelectiveSSMBlock", "LlamaDecoderLayer"]
    assert model.layers[0].config.d_model == 16 and model.layers[1].mlp.up_proj.in_features == 16


def test_causal_and_position_ids() -> None:
    torch.manual_seed(1)
    model = HybridLM(tiny_config()).double()
    ids = torch.randint(0, 256, (2, 13))
    changed = ids.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 256
    a, b = model(ids), model(changed)
    assert torch.allclose(a[:, :5], b[:, :5], rtol=0, atol=1e-13)
    assert not torch.allclose(a[:, 5:], b[:, 5:])
    assert torch.equal(model(ids, torch.arange(13).expand(2, 13)), a)


def test_every_parameter_gets_a_gradient() -> None:
    torch.manual_seed(2)
    model = HybridLM(tiny_config()).double()
    model(torch.randint(0, 256, (2, 13))).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_unknown_layer_kind() -> None:
    with pytest.raises(ValueError, match="mlp"):
        HybridConfig(layers=("ssm", "mlp"))
