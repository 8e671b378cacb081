"""Selective SSM LM: loop vs vectorized scans, float64, odd shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from examples_testing import compare_models, outputs_and_grads, rel_err, require_kernel
from examples.models.ssm import (
    LoopSSMLM,
    SelectiveSSMLM,
    SSMConfig,
    scan_associative,
    scan_associative_dense,
    scan_gradshard,
    scan_logcumsum,
)

TOL = 1e-12
SHAPES = [(b, t) for t in (1, 13, 37) for b in (1, 3)]
VARIANTS = [  # (decay, conv_kernel, learn_initial_state)
    ("diagonal", 0, False),
    ("diagonal", 4, True),
    ("scalar", 0, True),
    ("scalar", 4, False),
    ("dense", 0, False),
    ("dense", 4, True),
]


def tiny_config(decay: str = "diagonal", **kw) -> SSMConfig:
    scan = "associative_scan" if decay == "dense" else "loop_free_logcumsum"
    base = dict(d_model=16, n_layers=2, d_state=4, n_heads=4, decay=decay, scan=scan)
    return SSMConfig(**{**base, **kw})


def make_pair(config: SSMConfig, seed: int = 0) -> tuple[SelectiveSSMLM, LoopSSMLM]:
    torch.manual_seed(seed)
    vec = SelectiveSSMLM(config).double()
    loop = LoopSSMLM(config).double()
    loop.load_state_dict(vec.state_dict())
    return vec, loop


@pytest.mark.parametrize("decay,conv,h0", VARIANTS)
@pytest.mark.parametrize("batch,seq_len", SHAPES)
def test_loop_equals_vectorized(decay: str, conv: int, h0: bool, batch: int, seq_len: int) -> None:
    config = tiny_config(decay, conv_kernel=conv, learn_initial_state=h0)
    vec, loop = make_pair(config)
    ids = torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(seq_len))
    assert vec(ids).shape == (batch, seq_len, 256)
    compare_models(vec, loop, ids, tol=TOL)


@pytest.mark.parametrize("decay", ["diagonal", "scalar"])
@pytest.mark.parametrize("batch,seq_len", [(1, 13), (3, 37)])
def test_scan_options_agree(decay: str, batch: int, seq_len: int) -> None:
    base = tiny_config(decay, conv_kernel=4, learn_initial_state=True)
    torch.manual_seed(1)
    ref = SelectiveSSMLM(base).double()
    other = SelectiveSSMLM(dataclasses.replace(base, scan="associative_scan")).double()
    other.load_state_dict(ref.state_dict())
    compare_models(other, ref, torch.randint(0, 256, (batch, seq_len)), tol=TOL)


@pytest.mark.parametrize("decay", ["diagonal", "scalar"])
def test_gradshard_scan_agrees(decay: str) -> None:
    require_kernel("linear_scan")
    base = tiny_config(decay, learn_initial_state=True)
    vec, loop = make_pair(base, seed=2)
    model = SelectiveSSMLM(dataclasses.replace(base, scan="gradshard")).double()
    model.load_state_dict(vec.state_dict())
    compare_models(model, loop, torch.randint(0, 256, (3, 37)), tol=1e-10)


def reference_scan(
    a: torch.Tensor, u: torch.Tensor, h0: torch.Tensor | None, dense: bool = False
) -> torch.Tensor:
    """Per-step loop: ``h_t = a_t * h_{t-1} + u_t`` (``a_t @ h_{t-1}`` when dense)."""
    h = torch.zeros_like(u[:, 0]) if h0 is None else h0
    out = []
    for t in range(u.shape[1]):
        h = (a[:, t] @ h if dense else a[:, t] * h) + u[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("use_h0", [False, True])
@pytest.mark.parametrize("scan", [scan_logcumsum, scan_associative, scan_gradshard])
def test_diagonal_scan_functions(scan, use_h0: bool) -> None:
    if scan is scan_gradshard:
        require_kernel("linear_scan")
    gen = torch.Generator().manual_seed(3)
    a = (0.5 + 0.45 * torch.rand(3, 13, 4, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    u = torch.randn(3, 13, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True) if use_h0 else None
    inputs = [x for x in (a, u, h0) if x is not None]
    cot = torch.randn(3, 13, 4, 5, generator=gen, dtype=torch.float64)
    h = scan(a, u, h0)
    ref = reference_scan(a, u, h0)
    assert rel_err(h, ref) <= TOL
    for g, gr in zip(torch.autograd.grad(h, inputs, cot), torch.autograd.grad(ref, inputs, cot)):
        assert rel_err(g, gr) <= TOL


def test_dense_scan_function() -> None:
    gen = torch.Generator().manual_seed(4)
    eye = torch.eye(3, dtype=torch.float64)
    a = (0.9 * eye + 0.1 * torch.randn(2, 11, 3, 3, generator=gen, dtype=torch.float64)).requires_grad_()
    u = torch.randn(2, 11, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    cot = torch.randn(2, 11, 3, 6, generator=gen, dtype=torch.float64)
    h = scan_associative_dense(a, u, h0)
    ref = reference_scan(a, u, h0, dense=True)
    assert rel_err(h, ref) <= TOL
    for g, gr in zip(torch.autograd.grad(h, (a, u, h0), cot), torch.autograd.grad(ref, (a, u, h0), cot)):
        assert rel_err(g, gr) <= TOL


@pytest.mark.parametrize("decay", ["diagonal", "scalar", "dense"])
def test_every_parameter_gets_a_gradient(decay: str) -> None:
    vec, _ = make_pair(tiny_config(decay, conv_kernel=4, learn_initial_state=True))
    _, grads = outputs_and_grads(vec, torch.randint(0, 256, (2, 13)))
    for (name, _), g in zip(vec.named_parameters(), grads):
        assert g.abs().sum() > 0, name


@pytest.mark.parametrize("decay", ["diagonal", "scalar", "dense"])
def test_causal(decay: str) -> None:
    vec, loop = make_pair(tiny_config(decay, conv_kernel=4))
    ids = torch.randint(0, 256, (2, 13))
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    for model in (vec, loop):
        a, b = model(ids), model(changed)
        assert torch.allclose(a[:, :7], b[:, :7], rtol=0, atol=1e-13)
        assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_same_state_dict_and_parameter_counts() -> None:
    config = tiny_config("diagonal", conv_kernel=4, learn_initial_state=True)
    vec, loop = make_pair(config)
    assert list(vec.state_dict()) == list(loop.state_dict())
    layer = vec.layers[0]
    p, n = config.d_model, config.d_state
    for net in (layer.A, layer.B, layer.C):  # the paper's P·N + N parameters per network
        assert sum(t.numel() for t in net.parameters()) == p * n + n
    assert layer.h0.shape == (n, p)


def test_initial_decay_is_slow_and_in_unit_interval() -> None:
    vec, _ = make_pair(tiny_config("diagonal"))
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    a = vec.layers[0].transition(vec.layers[0].mixer_input(x))
    assert ((a > 0) & (a < 1)).all()


def test_tied_embeddings_share_storage() -> None:
    model = SelectiveSSMLM(tiny_config(tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight


@pytest.mark.parametrize("scan", ["loop_free_logcumsum", "gradshard"])
def test_dense_rejects_elementwise_scans(scan: str) -> None:
    with pytest.raises(ValueError, match="associative_scan"):
        SSMConfig(decay="dense", scan=scan)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="scan"):
        SSMConfig(scan="cumprod")
    with pytest.raises(ValueError, match="n_heads"):
        SSMConfig(decay="scalar", d_model=10, n_heads=4)
