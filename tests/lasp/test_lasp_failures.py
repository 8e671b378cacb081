"""plan="lasp" failure modes and contracts.

- A rank that raises mid-step makes every other rank fail with CommTimeoutError naming what
  it waited for, within the timeout (never a hang).
- Graphs LASP cannot run sequence-parallel fail at compile time with an error naming the
  node: softmax attention, non-causal linear attention, another recurrence, a lightning
  kernel whose final state is used.
- reduce_grads=False leaves per-rank partial gradients that sum to the full gradient.
- A loss computed inside the compiled function is returned as per-rank shares that sum to
  the full-sequence loss (mean cross-entropy with ignore_index, and means/sums of logits).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import gradshard as gs
from examples import factories
from gradshard.runtime.comm import CommTimeoutError
from gradshard.distributed.testing import run_threaded
from gradshard.errors import GradshardError, UnsupportedGraphError
from gradshard.plans.lasp.runtime import local_slice
from lasp_models import VOCAB, tiny_lm

TIMEOUT = 3.0


def test_rank_raising_mid_step_makes_the_others_fail_in_time() -> None:
    model, ids = tiny_lm("naive", "const", seq_len=17, batch=1)
    world = 4

    def body(rank: int, group: Any) -> Any:
        m = copy.deepcopy(model)
        cm = gs.compile(m, plan="lasp", group=group, timeout_s=TIMEOUT)
        x = local_slice(ids, rank, world)
        cm(x).sum().backward()  # one clean step (compiles on every rank)
        if rank == 1:
            def boom(*args: Any) -> Any:
                raise RuntimeError("injected failure in layer 1 on rank 1")

            cm.graph.lasp_1.forward = boom
        start = time.monotonic()
        try:
            cm(x).sum().backward()
        except Exception as exc:  # noqa: BLE001 - returned for the assertions
            return exc, time.monotonic() - start
        return None, time.monotonic() - start

    start = time.monotonic()
    results = run_threaded(world, body, timeout_s=60.0)
    total = time.monotonic() - start
    assert isinstance(results[1][0], RuntimeError) and "injected" in str(results[1][0])
    for rank in (0, 2, 3):
        exc, elapsed = results[rank]
        assert isinstance(exc, CommTimeoutError), (rank, exc)
        assert f"rank {rank} waited" in str(exc) and "layer 1" in str(exc)
        assert elapsed < 3 * TIMEOUT + 5
    assert total < 60


def _compile_single(model: torch.nn.Module, ids: torch.Tensor) -> Any:
    cm = gs.compile(model, plan="lasp")  # no torch.distributed: a single-rank group
    return cm.compiled_for(ids)


@pytest.mark.parametrize("impl,node,hint", [
    ("softmax", "softmax", "plan='seco'"),
    ("noncausal", "matmul_1", "not linear attention"),
])
def test_non_linear_attention_is_refused(impl: str, node: str, hint: str) -> None:
    model, ids = tiny_lm(impl, "none", seq_len=9, batch=2)
    with pytest.raises(UnsupportedGraphError) as info:
        _compile_single(model, ids)
    text = str(info.value)
    assert f"node `{node}`" in text and hint in text and "lasp_models.py" in text


def test_other_recurrence_is_refused() -> None:
    model, (ids,) = factories.ssm(seq_len=13, dtype=torch.float64)
    with pytest.raises(GradshardError) as info:
        _compile_single(model, ids)
    assert "plan='adjoint'" in str(info.value) or "no linear attention" in str(info.value)


def test_used_final_state_is_refused() -> None:
    from gradshard.kernels import lightning_attention

    class UsesState(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 12)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 1, 12).transpose(1, 2).split(4, -1)
            o, state = lightning_attention(q, k, v)
            return o.sum() + state.sum()

    x = torch.randn(2, 9, 4, dtype=torch.float64)
    with pytest.raises(UnsupportedGraphError, match="final state"):
        _compile_single(UsesState().double(), x)


def test_reduce_grads_false_keeps_partial_gradients() -> None:
    model, ids = tiny_lm("naive", "gated", seq_len=17, batch=3)
    ref = copy.deepcopy(model)
    ref(ids).pow(2).sum().backward()

    def body(rank: int, group: Any) -> Any:
        m = copy.deepcopy(model)
        cm = gs.compile(m, plan="lasp", group=group, reduce_grads=False)
        cm(local_slice(ids, rank, 2)).pow(2).sum().backward()
        assert not any(s.name.startswith("lasp_grad_sync") for s in cm.program.stages)
        return {n: p.grad for n, p in m.named_parameters()}

    grads = run_threaded(2, body)
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        total = grads[0][name] + grads[1][name]
        assert float((total - p.grad).norm() / p.grad.norm()) <= 1e-10, name
        assert float((grads[0][name] - p.grad).norm()) > 0  # partial, not already reduced


@pytest.mark.parametrize("loss", ["cross_entropy", "means"])
def test_loss_inside_is_split_into_shares(loss: str) -> None:
    model, ids = tiny_lm("recurrent", "gated", seq_len=17, batch=3, positions=True)
    labels = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(3))
    labels[0, 2] = labels[2, 14] = -100  # ignored targets on both ranks

    def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = m(x)
        if loss == "cross_entropy":
            return 2.0 * F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        return logits.pow(2).mean() + 0.01 * logits.sum(dim=(1, 2)).sum()

    ref = copy.deepcopy(model)
    full = loss_fn(ref, ids, labels)
    full.backward()

    def body(rank: int, group: Any) -> Any:
        m = copy.deepcopy(model)
        cm = gs.compile(loss_fn, plan="lasp", group=group)
        share = cm(m, local_slice(ids, rank, 2), local_slice(labels, rank, 2))
        share.backward()
        return share.detach(), {n: p.grad for n, p in m.named_parameters()}

    res = run_threaded(2, body)
    total = res[0][0] + res[1][0]
    full = full.detach()
    assert abs(float(total - full)) <= 1e-10 * abs(float(full))
    for name, p in ref.named_parameters():
        if p.grad is not None:
            for _, grads in res:
                assert float((grads[name] - p.grad).norm() / p.grad.norm()) <= 1e-10, name


def test_halo_wider_than_a_slice_is_refused() -> None:
    model, ids = tiny_lm("naive", "none", seq_len=9, batch=1, conv_kernel=5)  # reads 4 earlier steps

    def body(rank: int, group: Any) -> Any:
        # compiling is collective (the ranks exchange their lengths before the passes), and the
        # threads' captures run one at a time: give the exchange time for all four captures
        cm = gs.compile(copy.deepcopy(model), plan="lasp", group=group, timeout_s=60.0)
        try:
            cm.compiled_for(local_slice(ids, rank, 4))  # local lengths 3, 2, 2, 2
        except UnsupportedGraphError as exc:
            return str(exc)
        return None

    for text in run_threaded(4, body):
        assert text is not None and "needs the previous 4 step(s)" in text and "conv1d" in text
