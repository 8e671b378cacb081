"""Layer-sharded adjoint (paper Algorithms 3-4) on 2 and 4 thread-backed gloo ranks equals the
single-process gradients (float64, rel err <= 1e-10), and each rank holds only its layers."""

from __future__ import annotations

import copy

import pytest
import torch

import gradshard as gs
from examples.models.ssm import SelectiveSSMLM, SSMConfig
from examples.train_ssm import lm_loss, ssm_stage
from gradshard.distributed.adjoint import PipelineStage, split_layers
from gradshard.distributed.testing import run_threaded

from .helpers import rel_err

CFG = dict(vocab_size=29, d_model=8, n_layers=4, d_state=3, scan="gradshard", conv_kernel=3, learn_initial_state=True)


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 29, (2, 11), generator=g), torch.randint(0, 29, (2, 11), generator=g)


def _single_process(model):
    ids, labels = _batch()
    cm = gs.compile(model, plan="adjoint", shard_size=4)
    loss = lm_loss(cm(ids), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_split_layers():
    assert [list(r) for r in split_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError):
        split_layers(2, 3)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("plan", ["adjoint", "truncated_adjoint"])
def test_layer_sharded_equals_single_process(world, plan):
    torch.manual_seed(0)
    base = SelectiveSSMLM(SSMConfig(**CFG)).double()
    opts = {"window": 5} if plan == "truncated_adjoint" else {}
    if plan == "adjoint":
        ref_loss, ref_grads = _single_process(copy.deepcopy(base))
    else:
        model = copy.deepcopy(base)
        ids, labels = _batch()
        cm = gs.compile(model, plan=plan, shard_size=4, **opts)
        ref_loss = lm_loss(cm(ids), labels).detach()
        lm_loss(cm(ids), labels).backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in base.named_parameters()}

    def body(rank, group):
        model = copy.deepcopy(base)
        mine = {id(p): n for n, p in model.named_parameters()}
        stage_module = ssm_stage(model, rank, world)
        stage = PipelineStage(stage_module, group, plan=plan, shard_size=4, timeout_s=60, **opts)
        ids, labels = _batch()
        loss = stage.step(ids if rank == 0 else None, lambda out: lm_loss(out, labels))
        grads = {mine[id(p)]: p.grad.clone() for p in stage_module.parameters()}
        held = sum(p.numel() for p in stage_module.parameters())
        return loss, grads, held

    results = run_threaded(world, body, timeout_s=240, group_timeout_s=120)
    seen = set()
    for rank, (loss, grads, _) in enumerate(results):
        if rank == world - 1:
            assert rel_err(loss, ref_loss) <= 1e-12
        else:
            assert loss is None
        for n, g in grads.items():
            assert rel_err(g, ref_grads[n]) <= 1e-10, (rank, n)
            seen.add(n)
    assert seen == set(ref_grads)  # every parameter lives on exactly one rank
    held = [r[2] for r in results]
    total = sum(p.numel() for p in base.parameters())
    assert sum(held) == total
    del names
