"""LASP runtime: sequence-parallel linear attention on threaded gloo groups vs one process.

A multi-layer linear-attention stack (projections + lasp_attention + MLP) on 2 and 4 ranks
must reproduce the single-process outputs and float64 parameter/input gradients on the whole
sequence (rel err <= 1e-10), for no decay, a constant per-head decay and per-step gates, with
T divisible by neither the world size nor the chunk size, batch 1 and 3. Also: communication
volume (one state per layer and direction, independent of T), failing peers (CommTimeoutError
within the timeout), the loss/gradient-reduction convention, and the comm helpers.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import pytest
import torch
from torch import nn

from gradshard.runtime.comm import CommCounter, CommTimeoutError, Communicator
from gradshard.runtime.reduce import (
    global_mean,
    global_token_count,
    reduce_gradients,
    sum_over_group,
)
from gradshard.distributed.testing import run_threaded
from gradshard.plans.lasp.runtime import (
    dkv_label,
    kv_label,
    lasp_attention,
    local_slice,
    split_sequence,
)

DTYPE = torch.float64
D_MODEL, HEADS, DK, DV, HIDDEN, LAYERS = 5, 2, 3, 4, 7, 2
SEQ_LEN, CHUNK = 23, 5  # 23 is prime: no world size or chunk divides it


def naive_linear_attention(q, k, v, decay=None, *, initial_state=None, chunk_size=64, backend=None):
    """Token-by-token reference: kv_t = decay_t kv_{t-1} + k_t^T v_t, o_t = q_t kv_t."""
    b, h, t, dk = q.shape
    kv = initial_state if initial_state is not None else q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for i in range(t):
        if decay is not None:
            kv = (decay[None, :, None, None] if decay.dim() == 1 else decay[..., i, None, None]) * kv
        kv = kv + k[..., i, :, None] * v[..., i, None, :]
        outs.append((q[..., i, None, :] @ kv).squeeze(-2))
    return torch.stack(outs, -2), kv


def _lightning_kernel() -> Callable | None:
    try:
        from gradshard.kernels.lightning import lightning_attention
    except ImportError:
        return None
    return lightning_attention


KERNELS = {"naive": naive_linear_attention}
if _lightning_kernel() is not None:
    KERNELS["lightning"] = _lightning_kernel()


class Block(nn.Module):
    """Pre-projection linear attention (elu+1 feature map) + residual MLP."""

    def __init__(self, decay: str) -> None:
        super().__init__()
        self.decay = decay
        self.wq = nn.Linear(D_MODEL, HEADS * DK)
        self.wk = nn.Linear(D_MODEL, HEADS * DK)
        self.wv = nn.Linear(D_MODEL, HEADS * DV)
        self.wo = nn.Linear(HEADS * DV, D_MODEL)
        self.w1 = nn.Linear(D_MODEL, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, D_MODEL)
        if decay == "const":
            self.decay_logit = nn.Parameter(torch.linspace(0.5, 2.0, HEADS))
        if decay == "gate":
            self.wg = nn.Linear(D_MODEL, HEADS)

    def forward(self, x: torch.Tensor, attention: Callable) -> torch.Tensor:
        b, t, _ = x.shape
        heads = lambda y, d: y.view(b, t, HEADS, d).transpose(1, 2)  # noqa: E731
        q = torch.nn.functional.elu(heads(self.wq(x), DK)) + 1
        k = torch.nn.functional.elu(heads(self.wk(x), DK)) + 1
        v = heads(self.wv(x), DV)
        decay = None
        if self.decay == "const":
            decay = torch.sigmoid(self.decay_logit)
        elif self.decay == "gate":
            decay = torch.sigmoid(self.wg(x) + 1.0).transpose(1, 2)  # (B, H, T)
        o = attention(q, k, v, decay)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, HEADS * DV))
        return x + self.w2(torch.tanh(self.w1(x)))


class Stack(nn.Module):
    def __init__(self, decay: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(decay) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, attention_for_layer: Callable) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, attention_for_layer(i))
        return x


def _problem(decay: str, batch: int, seq_len: int = SEQ_LEN, seed: int = 0):
    torch.manual_seed(seed)
    model = Stack(decay).to(DTYPE)
    x = torch.randn(batch, seq_len, D_MODEL, dtype=DTYPE)
    target = torch.randn(batch, seq_len, D_MODEL, dtype=DTYPE)
    return model, x, target


def _reference(model: nn.Module, x: torch.Tensor, target: torch.Tensor):
    model = copy.deepcopy(model)
    x = x.clone().requires_grad_()
    attn = lambda i: lambda q, k, v, d: naive_linear_attention(q, k, v, d)[0]  # noqa: E731
    y = model(x, attn)
    loss = (y * target).sum() / (target.shape[0] * target.shape[1])  # mean over tokens
    loss.backward()
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}, loss.detach()


def _lasp_rank(rank: int, group: Any, model: nn.Module, x: torch.Tensor, target: torch.Tensor,
               kernel: Callable, reduce: bool = True, comm: Communicator | None = None,
               n_global: int | None = None):
    model = copy.deepcopy(model)
    world = group.size()
    xl = local_slice(x, rank, world, dim=1).clone().requires_grad_()
    tl = local_slice(target, rank, world, dim=1)
    # mean over ALL tokens: divide this rank's sum by the global token count
    if n_global is None:
        n_global = global_token_count(tl.shape[0] * tl.shape[1], group, comm=comm)
    attn = lambda i: lambda q, k, v, d: lasp_attention(  # noqa: E731
        q, k, v, d, group=group, layer_id=i, chunk_size=CHUNK, kernel=kernel, comm=comm
    )
    y = model(xl, attn)
    loss = (y * tl).sum() / n_global
    loss.backward()
    reduce_gradients(model.parameters(), group, comm=comm, reduce_grads=reduce)
    return (y.detach(), xl.grad, {n: p.grad for n, p in model.named_parameters()},
            sum_over_group(loss, group, comm=comm))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("decay", ["none", "const", "gate"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_lasp_stack_matches_single_process(world_size: int, decay: str, batch: int, kernel: str):
    model, x, target = _problem(decay, batch)
    y_ref, gx_ref, grads_ref, loss_ref = _reference(model, x, target)
    results = run_threaded(world_size, _lasp_rank, model, x, target, KERNELS[kernel])
    bounds = split_sequence(SEQ_LEN, world_size)
    for rank, (y, gx, grads, loss) in enumerate(results):
        start, stop = bounds[rank]
        assert y.shape[1] == stop - start
        assert _rel(y, y_ref[:, start:stop]) <= 1e-10, f"rank {rank} output"
        assert _rel(gx, gx_ref[:, start:stop]) <= 1e-10, f"rank {rank} input grad"
        assert _rel(loss, loss_ref) <= 1e-10, f"rank {rank} loss"
        assert grads.keys() == grads_ref.keys()
        for name, g in grads.items():
            assert _rel(g, grads_ref[name]) <= 1e-10, f"rank {rank} grad of {name}"
    if decay != "none":  # the decay parameters really received a gradient
        name = "blocks.0.decay_logit" if decay == "const" else "blocks.0.wg.weight"
        assert grads_ref[name].abs().max() > 1e-3


def test_reduce_grads_false_leaves_partial_sums():
    """Without the all-reduce each rank holds its tokens' share; the shares sum to the total."""
    model, x, target = _problem("gate", 3, seed=1)
    _, _, grads_ref, _ = _reference(model, x, target)
    results = run_threaded(3, _lasp_rank, model, x, target, naive_linear_attention, False)
    for name, g_ref in grads_ref.items():
        partial = [r[2][name] for r in results]
        assert _rel(sum(partial), g_ref) <= 1e-10, name
        assert _rel(partial[0], g_ref) > 1e-3, name  # a single share is not the gradient


def test_initial_and_final_state_gradients():
    """initial_state (rank 0) and the returned per-rank final states are exact and differentiable."""
    b, h, t, dk, dv, world = 3, 2, 13, 3, 2, 3
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, h, t, d, generator=gen, dtype=DTYPE) for d in (dk, dk, dv))
    gates = torch.rand(b, h, t, generator=gen, dtype=DTYPE) * 0.6 + 0.4
    gates[0, 1, 4] = 0.0  # an exactly-zero gate (state reset) is handled exactly
    h0 = torch.randn(b, h, dk, dv, generator=gen, dtype=DTYPE)
    w_o = torch.randn(b, h, t, dv, generator=gen, dtype=DTYPE)
    w_f = torch.randn(world, b, h, dk, dv, generator=gen, dtype=DTYPE)
    bounds = split_sequence(t, world)

    leaves = [x.clone().requires_grad_() for x in (q, k, v, gates, h0)]
    o, _ = naive_linear_attention(*leaves[:4], initial_state=leaves[4])
    loss = (o * w_o).sum()
    finals = []
    for r, (_, stop) in enumerate(bounds):  # state after each rank's last token
        f = naive_linear_attention(*(x[:, :, :stop] for x in leaves[:4]), initial_state=leaves[4])[1]
        finals.append(f.detach())
        loss = loss + (f * w_f[r]).sum()
    ref = torch.autograd.grad(loss, leaves)

    def body(rank, group):
        start, stop = bounds[rank]
        loc = [x[:, :, start:stop].clone().requires_grad_() for x in (q, k, v, gates)]
        h0r = h0.clone().requires_grad_()
        o_r, f_r = lasp_attention(*loc, group=group, layer_id=7, chunk_size=4,
                                  kernel=KERNELS.get("lightning", naive_linear_attention),
                                  initial_state=h0r, return_final_state=True)
        loss_r = (o_r * w_o[:, :, start:stop]).sum() + (f_r * w_f[rank]).sum()
        grads = torch.autograd.grad(loss_r, loc + [h0r], allow_unused=True)
        return o_r.detach(), f_r.detach(), grads

    results = run_threaded(world, body)
    for rank, (o_r, f_r, grads) in enumerate(results):
        start, stop = bounds[rank]
        assert _rel(o_r, o.detach()[:, :, start:stop]) <= 1e-10
        assert _rel(f_r, finals[rank]) <= 1e-10
        for g, g_ref in zip(grads[:4], ref[:4]):
            assert _rel(g, g_ref[:, :, start:stop]) <= 1e-10
        assert (grads[4] is None) == (rank != 0)
    assert _rel(results[0][2][4], ref[4]) <= 1e-10


def _count_rank(rank, group, model, x, target):
    with CommCounter(group) as counter:
        _lasp_rank(rank, group, model, x, target, naive_linear_attention)
    return counter.stats()


def test_bytes_per_layer_are_one_state_and_independent_of_T():
    world, batch = 3, 3
    state_bytes = batch * HEADS * DK * DV * torch.finfo(DTYPE).bits // 8
    seen = {}
    for seq_len in (7, 20):
        model, x, target = _problem("gate", batch, seq_len=seq_len)
        per_rank = run_threaded(world, _count_rank, model, x, target)
        seen[seq_len] = {
            r: {key: s for key, s in stats.items() if key[0].startswith("lasp.")}
            for r, stats in enumerate(per_rank)
        }
        for rank, stats in enumerate(per_rank):
            for layer in range(LAYERS):
                expect = {
                    (kv_label(layer), "send"): rank < world - 1,
                    (kv_label(layer), "recv"): rank > 0,
                    (dkv_label(layer), "send"): rank > 0,
                    (dkv_label(layer), "recv"): rank < world - 1,
                }
                for key, present in expect.items():
                    if present:
                        assert stats[key].bytes == state_bytes, (rank, key)
                        assert stats[key].messages == 1, (rank, key)
                    else:
                        assert key not in stats, (rank, key)
    assert seen[7] == seen[20]


def _failing_rank(rank, group, model, x, target, fail_rank, timeout_s, dead=False):
    if dead and rank == fail_rank:
        return None, 0.0  # the rank disappears: its group is destroyed, its sockets close
    comm = Communicator(group, timeout_s=timeout_s)
    calls = []

    def kernel(*args, **kwargs):
        calls.append(1)
        if rank == fail_rank and len(calls) == 2:  # dies in layer 1, after layer 0 went fine
            raise RuntimeError("simulated failure inside layer 1")
        return naive_linear_attention(*args, **kwargs)

    t0 = time.monotonic()
    try:
        _lasp_rank(rank, group, model, x, target, kernel, comm=comm,
                   n_global=x.shape[0] * x.shape[1])
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return exc, time.monotonic() - t0
    return None, time.monotonic() - t0


def test_failing_peer_raises_comm_timeout_within_timeout():
    timeout_s, world, fail_rank = 3.0, 3, 1
    model, x, target = _problem("none", 1)
    t0 = time.monotonic()
    results = run_threaded(world, _failing_rank, model, x, target, fail_rank, timeout_s,
                           timeout_s=30.0)
    assert time.monotonic() - t0 < timeout_s + 10
    for rank, (exc, elapsed) in enumerate(results):
        if rank == fail_rank:
            assert isinstance(exc, RuntimeError) and "simulated failure" in str(exc)
            continue
        assert isinstance(exc, CommTimeoutError), f"rank {rank}: {exc!r}"
        assert elapsed < timeout_s + 5, f"rank {rank} took {elapsed:.1f} s"
        text = str(exc)
        assert f"rank {rank} waited" in text and "rank 1" in text, text
        assert "KV state of layer 1" in text, text


def test_split_sequence():
    assert split_sequence(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert split_sequence(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_sequence(5, 1) == [(0, 5)]
    for t, w in [(23, 2), (23, 4), (100, 7)]:
        parts = split_sequence(t, w)
        assert parts[0][0] == 0 and parts[-1][1] == t
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        lengths = [b - a for a, b in parts]
        assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
    with pytest.raises(ValueError, match="at least one token"):
        split_sequence(3, 4)


def _comm_basics(rank, group):
    comm = Communicator(group, timeout_s=10)
    peer = 1 - rank
    with CommCounter(group) as counter:
        buf = torch.zeros(5)
        if rank == 0:
            comm.send(torch.arange(5.0), peer, tag=3, label="probe")
        else:
            comm.recv(buf, peer, tag=3, label="probe")
        total = comm.all_reduce(torch.tensor([float(rank + 1)]), label="sum")
    with pytest.raises(ValueError, match="invalid destination"):
        comm.isend(buf, rank, tag=0, label="self")
    count = global_token_count(10 + rank, group)
    share = global_mean(torch.tensor(21.0), 10 + rank, group)  # 21 / 21 tokens
    # ranks pass different parameter lists: a clear error on every rank, no silent mixing
    params = [nn.Parameter(torch.ones(3))] * (rank + 1)
    for p in params:
        p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="different parameter lists"):
        reduce_gradients(params, group)
    return buf, total, counter.stats(), count, share


def test_comm_helpers_count_and_check():
    (b0, t0, s0, c0, m0), (b1, t1, s1, c1, m1) = run_threaded(2, _comm_basics)
    assert torch.equal(b1, torch.arange(5.0)) and t0.item() == t1.item() == 3.0
    assert s0[("probe", "send")].bytes == 20 and ("probe", "recv") not in s0
    assert s1[("probe", "recv")].bytes == 20 and s1[("sum", "allreduce")].messages == 1
    assert c0 == c1 == 21 and m0.item() == m1.item() == 1.0


def test_dead_peer_fails_fast_with_comm_timeout():
    timeout_s, world, dead_rank = 3.0, 3, 1
    model, x, target = _problem("const", 1)
    results = run_threaded(world, _failing_rank, model, x, target, dead_rank, timeout_s, True,
                           timeout_s=30.0)
    for rank, (exc, elapsed) in enumerate(results):
        if rank == dead_rank:
            continue
        assert isinstance(exc, CommTimeoutError), f"rank {rank}: {exc!r}"
        assert elapsed < timeout_s + 5, f"rank {rank} took {elapsed:.1f} s"
        assert f"rank {rank} " in str(exc) and "rank 1" in str(exc), str(exc)
