"""Llama-style transformer: sdpa vs explicit softmax, GQA repeat forms, RoPE, HF-style output."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from examples_testing import compare_models, rel_err
from examples.models.llama import CausalLMOutput, LlamaConfig, LlamaForCausalLM, LlamaLM, repeat_kv

TOL = 1e-12
SHAPES = [(b, t) for t in (1, 13, 37) for b in (1, 3)]


def tiny_config(**kw) -> LlamaConfig:
    base = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=48)
    return LlamaConfig(**{**base, **kw})


def build(config: LlamaConfig, cls: type = LlamaLM, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return cls(config).double()


def twin(model: torch.nn.Module, config: LlamaConfig, cls: type = LlamaLM) -> torch.nn.Module:
    other = cls(config).double()
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("batch,seq_len", SHAPES)
def test_sdpa_equals_explicit_softmax(batch: int, seq_len: int) -> None:
    config = tiny_config()
    sdpa = build(config)
    explicit = twin(sdpa, dataclasses.replace(config, attention="explicit"))
    ids = torch.randint(0, 256, (batch, seq_len))
    assert sdpa(ids).shape == (batch, seq_len, 256)
    compare_models(sdpa, explicit, ids, tol=TOL)


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_repeat_kv_forms_agree(attention: str) -> None:
    config = tiny_config(attention=attention, n_kv_heads=1)
    expand = build(config)
    interleave = twin(expand, dataclasses.replace(config, kv_repeat="repeat_interleave"))
    compare_models(expand, interleave, torch.randint(0, 256, (3, 13)), tol=TOL)


def test_repeat_kv_matches_repeat_interleave() -> None:
    x = torch.randn(2, 3, 5, 4)
    assert torch.equal(repeat_kv(x, 3), x.repeat_interleave(3, dim=1))
    assert repeat_kv(x, 1) is x


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_rope_depends_only_on_relative_positions(attention: str) -> None:
    model = build(tiny_config(attention=attention))
    ids = torch.randint(0, 256, (2, 13))
    default = model(ids)
    explicit = model(ids, torch.arange(13).expand(2, 13))
    shifted = model(ids, torch.arange(13).expand(2, 13) + 11)
    assert torch.equal(default, explicit)
    assert rel_err(shifted, default) <= 1e-10
    reversed_positions = model(ids, torch.arange(13).flip(0).expand(2, 13))
    assert rel_err(reversed_positions, default) > 1e-3  # positions do matter


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_causal(attention: str) -> None:
    model = build(tiny_config(attention=attention))
    ids = torch.randint(0, 256, (2, 13))
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 256
    a, b = model(ids), model(changed)
    assert torch.allclose(a[:, :6], b[:, :6], rtol=0, atol=1e-13)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_hf_style_output_and_loss() -> None:
    config = tiny_config()
    plain = build(config)
    hf = twin(plain, config, LlamaForCausalLM)
    assert list(plain.state_dict()) == list(hf.state_dict())
    ids = torch.randint(0, 256, (3, 13))
    out = hf(ids)
    assert isinstance(out, CausalLMOutput) and out.loss is None
    assert torch.equal(out.logits, plain(ids))
    labels = ids.clone()
    labels[0, 5] = -100
    out = hf(ids, None, labels)
    logits = plain(ids)
    keep = labels[:, 1:] != -100
    manual = F.cross_entropy(logits[:, :-1][keep], labels[:, 1:][keep])
    assert rel_err(out.loss, manual) <= TOL
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in hf.parameters())


def test_tied_embeddings() -> None:
    model = build(tiny_config(tie_embeddings=True))
    assert model.lm_head.weight is model.embed_tokens.weight
    assert len(list(model.parameters())) == len(list(build(tiny_config()).parameters())) - 1


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="attention"):
        LlamaConfig(attention="flash")
