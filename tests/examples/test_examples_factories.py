"""CLI factories: no required arguments, (model_or_fn, example_inputs) that run, overrides."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from examples import factories
from examples.models.llama import CausalLMOutput

NEEDS_KERNEL = {
    "ssm_gradshard_scan": "linear_scan",
    "linear_attention_gradshard": "lightning_attention",
}


def _skip_without_kernel(name: str) -> None:
    """The factories that call a gradshard kernel need it to exist (no skip: it ships with us)."""
    if name in NEEDS_KERNEL:
        import gradshard.kernels as kernels

        assert hasattr(kernels, NEEDS_KERNEL[name]), f"gradshard.kernels.{NEEDS_KERNEL[name]} is missing"


def _scalar(out) -> torch.Tensor:
    if isinstance(out, CausalLMOutput):
        return out.loss
    return out if out.dim() == 0 else out.float().square().mean()


@pytest.mark.parametrize("name", sorted(factories.FACTORIES))
def test_factory_defaults_run(name: str) -> None:
    _skip_without_kernel(name)
    fn, inputs = factories.FACTORIES[name]()
    assert isinstance(inputs, tuple)
    out = fn(*inputs)
    if isinstance(out, torch.Tensor) and out.dim() == 3:
        assert out.shape == (2, 32, 256) and out.dtype == torch.float32
    loss = _scalar(out)
    assert torch.isfinite(loss)
    loss.backward()


@pytest.mark.parametrize("name", sorted(factories.FACTORIES))
def test_factory_overrides(name: str) -> None:
    _skip_without_kernel(name)
    fn, inputs = factories.FACTORIES[name](seq_len=13, batch=3, dtype=torch.float64)
    model = inputs[0] if name == "llama_loss" else fn
    assert all(p.dtype == torch.float64 for p in model.parameters())
    ids = inputs[1][0] if name == "llama_loss" else inputs[0]
    assert ids.shape == (3, 13)
    out = fn(*inputs)
    assert torch.isfinite(_scalar(out))


def test_config_override_and_unknown_override() -> None:
    model, _ = factories.ssm(d_model=48, n_layers=3)
    assert model.config.d_model == 48 and len(model.layers) == 3
    with pytest.raises(TypeError, match="d_modle"):
        factories.llama(d_modle=48)


def test_llama_loss_is_cross_entropy() -> None:
    fn, (model, batch) = factories.llama_loss()
    input_ids, labels = batch
    logits = model(input_ids)
    assert torch.allclose(fn(model, batch), F.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1)))
    assert torch.equal(labels[:, :-1], input_ids[:, 1:])


def test_loadable_by_file_path() -> None:
    path = Path(factories.__file__)
    spec = importlib.util.spec_from_file_location("factories_by_path", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, (ids,) = module.ssm_loop()
    assert model(ids).shape == (2, 32, 256)
