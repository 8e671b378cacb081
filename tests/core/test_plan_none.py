"""plan="none": capture + the whole pipeline preserves outputs and float64 gradients exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gradshard as gs
from examples import factories

from .helpers import assert_identical, run_both
from .models import CausalSelfAttention, CumsumMixer, LoopRNN, SDPABlock, TimeFirst

EXAMPLES = sorted(factories.FACTORIES)


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_identical_to_eager(name):
    target, inputs = factories.FACTORIES[name](dtype=torch.float64, seq_len=13, batch=3)
    o1, o2, g1, g2 = run_both(lambda t: gs.compile(t, plan="none"), target, inputs)
    assert_identical(o1, o2)
    assert_identical(g1, g2)


def _torch_transformer():
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = model

        def forward(self, x):
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
            return self.enc(x, mask=mask, is_causal=True)

    return Causal()


EXTERNAL = {
    # written outside this repo: PyTorch's own modules
    "torch_transformer_encoder": (_torch_transformer, (3, 11, 16)),
    "torch_gru": (lambda: nn.GRU(8, 8, batch_first=True), (1, 9, 8)),
    "torch_conv_stack": (lambda: nn.Sequential(nn.Conv1d(9, 8, 3, padding=1), nn.GELU(), nn.Conv1d(8, 8, 5, padding=2)), (3, 9, 17)),
    # written as users write them
    "explicit_attention": (lambda: CausalSelfAttention(mask="masked_fill"), (3, 7, 8)),
    "sdpa_block": (SDPABlock, (1, 9, 8)),
    "loop_rnn": (LoopRNN, (3, 7, 8)),
    "time_first": (TimeFirst, (7, 3, 8)),
    "cumsum": (CumsumMixer, (2, 5, 8)),
}


@pytest.mark.parametrize("name", sorted(EXTERNAL))
@pytest.mark.parametrize("frontend", ["python", "dynamo"])
def test_external_models_identical_to_eager(name, frontend):
    make, shape = EXTERNAL[name]
    torch.manual_seed(0)
    model = make().double()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    o1, o2, g1, g2 = run_both(lambda t: gs.compile(t, plan="none", frontend=frontend), model, (x,))
    assert_identical(o1, o2)
    assert_identical(g1, g2, rtol=1e-12 if frontend == "dynamo" else 0.0)


def test_loss_function_with_model_argument():
    target, (model, batch) = factories.llama_loss(dtype=torch.float64, seq_len=11, batch=3)
    cm = gs.compile(target, plan="none")
    o1, o2, g1, g2 = run_both(lambda t: gs.compile(t, plan="none"), target, (model, batch))
    assert_identical(o1, o2)
    assert_identical(g1, g2)
    assert cm is not None


def test_gradients_land_in_the_users_parameters():
    model = SDPABlock().double()
    cm = gs.compile(model)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    cm(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert {n for n, _ in cm.named_parameters()} == {f"model.{n}" for n, _ in model.named_parameters()}


def test_new_shapes_are_recaptured_not_reused():
    model = CumsumMixer().double()
    cm = gs.compile(model)
    for T in (5, 9, 5):
        x = torch.randn(2, T, 8, dtype=torch.float64)
        assert torch.equal(cm(x), model(x))
    assert len(cm._cache) == 2


@pytest.mark.slow  # Inductor; tests/compose/test_compose_inductor.py checks plan none under torch.compile in the default suite
def test_torch_compile_backend():
    torch.manual_seed(0)
    model = SDPABlock().double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    be = gs.backend(plan="none")
    compiled = torch.compile(model, backend=be, dynamic=False)
    o1, o2, g1, g2 = run_both(lambda t: torch.compile(t, backend=be, dynamic=False), model, (x,))
    assert_identical(o1, o2, rtol=1e-12)
    assert_identical(g1, g2, rtol=1e-12)
    assert be.compiled and be.compiled[0].plan == "none"
    del compiled


def test_compiling_does_not_consume_the_random_stream():
    """Dropout in training mode: a seeded first call (which captures and compiles) draws the
    same masks as eager, and gradients follow those masks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Dropout(0.4), nn.GELU(), nn.Linear(7, 3)).double().train()
    x = torch.randn(2, 9, 5, dtype=torch.float64)
    cm = gs.compile(model, plan="none", time_axis=(0, 1))
    torch.manual_seed(11)
    out = cm(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.manual_seed(11)
    want = model(x)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)
