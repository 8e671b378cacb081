"""plan="adjoint" is exact (float64, rel err <= 1e-10) on small user-written models.

Odd sizes throughout: T=11 with shard_size=4 (T not a multiple of the shard), batch 1 and 3.
"""

from __future__ import annotations

import pytest
import torch

import gradshard as gs

from .helpers import assert_same_grads, grads_of, rel_err
from .models import (CumsumMixer, DenseLoopSSM, DiagonalSSM, FinalStateSSM, LoopProducersRNN,
                     StateFirstS4D, init_like_training)

T = 11


def _x(batch: int, d: int, T: int = T) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, T, d, dtype=torch.float64)


@pytest.mark.parametrize("scan", ["loop", "gradshard", "cumprod", "associative"])
@pytest.mark.parametrize("batch,h0", [(1, False), (3, True)])
def test_diagonal_forms(scan, batch, h0):
    model = init_like_training(DiagonalSSM(scan=scan, h0=h0))
    cm = assert_same_grads(model, (_x(batch, 6),), shard_size=4)
    assert len([r for r in cm.regions if r.kind == "linear_recurrence"]) == 2


@pytest.mark.parametrize("batch", [1, 3])
def test_scalar_per_head_with_causal_conv(batch):
    model = init_like_training(DiagonalSSM(d=6, n=3, heads=2, conv=True, h0=True, scan="gradshard"))
    cm = assert_same_grads(model, (_x(batch, 6),), shard_size=4)
    halos = {r.options["halo"] for r in cm.regions if r.kind == "linear_recurrence"}
    assert halos == {"2/0"}, halos  # the width-3 causal conv: two steps of left halo


@pytest.mark.parametrize("batch,h0", [(1, False), (3, True)])
def test_dense_loop(batch, h0):
    model = init_like_training(DenseLoopSSM(h0=h0))
    cm = assert_same_grads(model, (_x(batch, 4),), shard_size=4)
    assert {r.options["form"] for r in cm.regions if r.kind == "linear_recurrence"} == {"dense"}


@pytest.mark.parametrize("h0", [False, True])
def test_loop_with_per_step_producers(h0):
    model = init_like_training(LoopProducersRNN(h0=h0))
    assert_same_grads(model, (_x(3, 5),), shard_size=3)


@pytest.mark.parametrize("batch", [1, 3])
def test_loop_with_the_state_term_first(batch):
    # `dA * h` is evaluated before the step's input is read: the op on the previous state
    # belongs to the next step, and step 0's `dA * h0` reads no step of the sequence
    model = init_like_training(StateFirstS4D())
    cm = assert_same_grads(model, (_x(batch, 5),), shard_size=4)
    assert [r.options["written_as"] for r in cm.regions if r.kind == "linear_recurrence"] == ["rolled loop (11 steps)"]
    out, grads, _ = grads_of(model, (_x(batch, 5, T=23),), cm)  # the rolled program at another length
    ref_out, ref_grads, _ = grads_of(model, (_x(batch, 5, T=23),))
    assert rel_err(out[0], ref_out[0]) <= 1e-10
    assert max(rel_err(grads[n], g) for n, g in ref_grads.items()) <= 1e-10


def test_loop_over_unbind():
    # the core's time-axis inference does not count unbind as loop evidence: pass the axis
    model = init_like_training(LoopProducersRNN(unbind=True))
    assert_same_grads(model, (_x(2, 5),), shard_size=3, time_axis=(0, 1))


def test_cumsum_is_a_scan_with_unit_decay():
    model = init_like_training(CumsumMixer())
    cm = assert_same_grads(model, (_x(2, 5),), shard_size=4)
    assert [r.options["form"] for r in cm.regions if r.kind == "linear_recurrence"] == ["diagonal (a=1)"]


def test_final_state_output():
    model = init_like_training(FinalStateSSM())
    assert_same_grads(model, (_x(2, 4),), shard_size=3)


@pytest.mark.parametrize("shard", [1, 5, 11, 64])
def test_shard_sizes(shard):
    model = init_like_training(DiagonalSSM(scan="gradshard", conv=True, h0=True))
    assert_same_grads(model, (_x(2, 6),), shard_size=shard)


def test_forward_only_and_no_grad_inputs():
    model = init_like_training(DiagonalSSM(scan="gradshard"))
    cm = gs.compile(model, plan="adjoint", shard_size=4)
    x = _x(2, 6)
    with torch.no_grad():
        assert torch.allclose(cm(x), model(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loop", [False, True])
def test_initial_state_as_input_gets_its_gradient(loop):
    from .models import StateInputSSM

    model = init_like_training(StateInputSSM(loop=loop))
    h0 = torch.randn(3, 4, dtype=torch.float64)
    assert_same_grads(model, (_x(3, 4), h0), shard_size=4)
