"""Outer loop (Algorithm 1 of the partial-updates paper) on threaded gloo ranks.

Each test runs the real ``PartialDiLoCo`` on K threads and compares, after every sync,
against ``reference_algorithm_1`` below: a single-process transcription of the paper's
Algorithm 1 on *full* parameter tensors with explicit index masks (no slicing machinery,
no collectives), with a hand-written AdamW as the inner optimizer.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from gradshard.distributed.diloco import DiLoCo, DiLoCoError, PartialDiLoCo, due_fragment, make_fragments
from gradshard.runtime.comm import CommCounter
from gradshard.distributed.testing import run_threaded
from gradshard.plans.partial_update.runtime import (
    attention_layouts,
    full_parameters,
    mlp_in_layout,
    mlp_out_layout,
    slice_linears,
)

DT = torch.float64
D, HEADS, KV, HD, HIDDEN = 6, 6, 3, 2, 7
LR, BETAS, EPS, WD = 0.05, (0.9, 0.95), 1e-8, 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(D))
        self.q = nn.Linear(D, HEADS * HD, bias=True)
        self.k = nn.Linear(D, KV * HD, bias=False)
        self.v = nn.Linear(D, KV * HD, bias=False)
        self.o = nn.Linear(HEADS * HD, D, bias=False)
        self.up = nn.Linear(D, HIDDEN, bias=False)
        self.gate = nn.Linear(D, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, D, bias=True)

    def forward(self, x):
        b, t, _ = x.shape
        h = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.norm
        q = self.q(h).view(b, t, HEADS, HD).transpose(1, 2)
        k = self.k(h).view(b, t, KV, HD).transpose(1, 2).repeat_interleave(HEADS // KV, dim=1)
        v = self.v(h).view(b, t, KV, HD).transpose(1, 2).repeat_interleave(HEADS // KV, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(HD)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        x = x + self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_net() -> Net:
    """Identical on every thread: parameters come from a private generator."""
    net = Net().to(DT)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=DT) * 0.4)
    return net


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    return torch.randn(2, 5, 3, generator=g, dtype=DT), torch.randn(2, 5, 1, generator=g, dtype=DT)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean()


def layouts(num_slices: int, index: int) -> dict:
    out = {}
    q, kv = attention_layouts(HEADS, KV, HD, num_slices, index)
    for i in range(2):
        p = f"layers.{i}."
        out.update({p + "q": q, p + "k": kv, p + "v": kv})
        out.update({p + "up": mlp_in_layout(HIDDEN, num_slices, index), p + "gate": mlp_in_layout(HIDDEN, num_slices, index)})
        out[p + "down"] = mlp_out_layout(HIDDEN, num_slices, index)
    return out


def sliced_net(num_slices: int, index: int) -> Net:
    return slice_linears(make_net(), layouts(num_slices, index)) if num_slices > 1 else make_net()


# --------------------------------------------------------------------------- reference


def reference_masks(num_slices: int, k: int) -> dict[str, torch.Tensor]:
    """Full-shape masks of the entries rank k trains (Algorithm 1's I_k^train)."""
    masks = {n: torch.ones_like(p, dtype=torch.bool) for n, p in make_net().named_parameters()}
    if num_slices == 1:
        return masks
    for mod, lay in layouts(num_slices, k % num_slices).items():
        lo, hi = lay.trainable_span
        m = torch.zeros_like(masks[mod + ".weight"])
        m.narrow(lay.dim, lo, hi - lo).fill_(True)
        masks[mod + ".weight"] = m
        if lay.dim == 0 and mod + ".bias" in masks:
            mb = torch.zeros_like(masks[mod + ".bias"])
            mb[lo:hi] = True
            masks[mod + ".bias"] = mb
    return masks


def reference_algorithm_1(
    K: int, N: int, H: int, steps: int, *, outer_lr: float, mu: float, fragments: list[list[str]] | None = None
) -> list[dict[str, torch.Tensor]]:
    """Algorithm 1 on full tensors; returns theta_global after every sync."""
    net = make_net()
    theta = {n: p.detach().clone() for n, p in net.named_parameters()}
    fragments = fragments or [list(theta)]
    P = len(fragments)
    masks = [reference_masks(N, k) for k in range(K)]
    local = [{n: t.clone() for n, t in theta.items()} for _ in range(K)]
    adam = [{n: (torch.zeros_like(t), torch.zeros_like(t)) for n, t in theta.items()} for _ in range(K)]
    momentum = {n: torch.zeros_like(t) for n, t in theta.items()}
    snapshots = []
    for s in range(1, steps + 1):
        for k in range(K):
            params = {n: t.clone().requires_grad_() for n, t in local[k].items()}
            x, y = batch(k, s)
            loss = loss_fn(functional_call(net, params, (x,)), y)
            grads = torch.autograd.grad(loss, list(params.values()))
            for (n, p), g in zip(local[k].items(), grads):
                m_, v_ = adam[k][n]
                m_ = BETAS[0] * m_ + (1 - BETAS[0]) * g
                v_ = BETAS[1] * v_ + (1 - BETAS[1]) * g * g
                step = s  # every trained entry is updated at every step
                upd = (m_ / (1 - BETAS[0] ** step)) / ((v_ / (1 - BETAS[1] ** step)).sqrt() + EPS)
                new = p * (1 - LR * WD) - LR * upd
                mask = masks[k][n]
                local[k][n] = torch.where(mask, new, p)
                adam[k][n] = (torch.where(mask, m_, 0.0), torch.where(mask, v_, 0.0))
        tau = H // P
        if s % tau == 0:
            f = (s // tau - 1) % P
            for n in fragments[f]:
                total = sum(torch.where(masks[k][n], local[k][n] - theta[n], 0.0) for k in range(K))
                count = sum(masks[k][n].to(DT) for k in range(K))
                avg_update = torch.where(count > 0, total / count.clamp_min(1), 0.0)  # line 14
                outer_grad = -avg_update
                momentum[n] = mu * momentum[n] + outer_grad
                theta[n] = theta[n] - outer_lr * (outer_grad + mu * momentum[n])  # Nesterov SGD
                for k in range(K):
                    local[k][n] = theta[n].clone()
            snapshots.append({n: t.clone() for n, t in theta.items()})
    return snapshots


# --------------------------------------------------------------------------- the real thing


def train(rank, group, N, H, steps, outer_lr, mu, fragments=1, stop=None, resume=None, ckpt=None):
    """Run PartialDiLoCo on one rank; return full params after each sync (+ final state)."""
    net = sliced_net(N, rank % N)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    outer = PartialDiLoCo(
        net, opt, outer_lr=outer_lr, outer_momentum=mu, sync_every=H, group=group, fragments=fragments
    )
    start = 0
    if resume is not None:
        outer.load(resume)
        start = outer.inner_steps
    snaps = []
    for s in range(start + 1, steps + 1):
        x, y = batch(rank, s)
        loss_fn(net(x), y).backward()
        if outer.step() is not None:
            snaps.append({n: t.clone() for n, t in full_parameters(net).items()})
        if stop is not None and s == stop:
            outer.save(ckpt)
            return None
    return {
        "snaps": snaps,
        "counts": outer.counts,
        "fragments": outer.fragments,
        "state": {k: v for k, v in outer.state_dict(include_rng=False).items()},
    }


def _assert_close(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), what
    for n in a:
        err = ((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)).item()
        assert err <= 1e-10, f"{what}: `{n}` rel err {err:.2e}"


@pytest.mark.parametrize("K,N", [(2, 2), (4, 2), (2, 3), (2, 1)])
def test_replicas_identical_and_equal_to_reference(K: int, N: int) -> None:
    H, steps, lr, mu = 3, 7, 0.7, 0.9
    results = run_threaded(K, train, N, H, steps, lr, mu)
    ref = reference_algorithm_1(K, N, H, steps, outer_lr=lr, mu=mu)
    assert len(ref) == 2 and all(len(r["snaps"]) == 2 for r in results)
    for i, expect in enumerate(ref):
        for r in range(K):  # bit-identical replicas after every sync
            for n, t in results[r]["snaps"][i].items():
                assert torch.equal(t, results[0]["snaps"][i][n]), f"sync {i}: rank {r} differs at {n}"
        _assert_close(results[0]["snaps"][i], expect, f"sync {i}")
    counts = results[0]["counts"]
    assert torch.all(counts["layers.0.norm"] == K)
    if N > 1:
        c = counts["layers.0.up.weight"].flatten()
        per_slice = [K // N + (1 if j < K % N else 0) for j in range(N)]
        bounds = mlp_in_layout(HIDDEN, N, 0).bounds
        for j in range(N):
            assert torch.all(c[bounds[j] : bounds[j + 1]] == per_slice[j])


def test_untrained_slices_get_zero_update() -> None:
    # K=2 ranks, N=3 slices: slice 2 of every sliced weight is trained by nobody (m = 0)
    results = run_threaded(2, train, 3, 2, 4, 0.7, 0.9)
    init = full_parameters(sliced_net(3, 0))
    final = results[0]["snaps"][-1]
    lay = mlp_in_layout(HIDDEN, 3, 2)
    lo, hi = lay.trainable_span
    assert torch.equal(final["layers.1.up.weight"][lo:hi], init["layers.1.up.weight"][lo:hi])
    assert not torch.equal(final["layers.1.up.weight"][:lo], init["layers.1.up.weight"][:lo])
    assert torch.all(results[0]["counts"]["layers.1.up.weight"].flatten()[lo:hi] == 0)


def test_streaming_fragments_follow_schedule_and_reference() -> None:
    K, N, H, steps, lr, mu = 2, 2, 4, 10, 0.7, 0.9
    results = run_threaded(K, train, N, H, steps, lr, mu, 2)
    names = list(dict(make_net().named_parameters()))
    frag = results[0]["fragments"]
    # strided layers; inp/head (no layer index) join the smaller fragment (tie -> 0)
    assert frag[0] == [n for n in names if not n.startswith("layers.1.")]
    assert frag[1] == [n for n in names if n.startswith("layers.1.")]
    # syncs after steps 2 (f0), 4 (f1), 6 (f0), 8 (f1), 10 (f0)
    assert [due_fragment(s, H, 2) for s in range(1, 11)] == [None, 0, None, 1, None, 0, None, 1, None, 0]
    ref = reference_algorithm_1(K, N, H, steps, outer_lr=lr, mu=mu, fragments=frag)
    assert len(ref) == len(results[0]["snaps"]) == 5
    for i, expect in enumerate(ref):
        synced = frag[i % 2]  # only the synced fragment is global; the other is mid-round
        for r in range(K):
            for n in synced:
                t = results[r]["snaps"][i][n]
                assert torch.equal(t, results[0]["snaps"][i][n]), f"sync {i}: rank {r} differs at {n}"
        got = {n: results[0]["snaps"][i][n] for n in synced}
        _assert_close(got, {n: expect[n] for n in synced}, f"sync {i}")
        if i == 0:  # the other fragment really is still local (differs across ranks)
            n = frag[1][0]
            assert not torch.equal(results[0]["snaps"][0][n], results[1]["snaps"][0][n])


def test_make_fragments_patterns_and_errors() -> None:
    numels = {"emb": 10, "l.0.a": 3, "l.0.b": 3, "l.1.a": 3, "l.2.a": 3, "l.3.a": 3, "out": 1}
    # strided: layers 0, 2 (9 elements) | layers 1, 3 (6): the rest joins the smaller one
    assert make_fragments(numels, 2) == [["l.0.a", "l.0.b", "l.2.a"], ["emb", "l.1.a", "l.3.a", "out"]]
    assert make_fragments(numels, 2, "sequential") == [["l.0.a", "l.0.b", "l.1.a"], ["emb", "l.2.a", "l.3.a", "out"]]
    with pytest.raises(DiLoCoError, match="only 4 layer"):
        make_fragments(numels, 5)
    with pytest.raises(DiLoCoError, match="missing"):
        make_fragments(numels, [["emb"], ["out"]])


@pytest.mark.parametrize(
    "fragments,H,stop",
    [(1, 3, 3), (1, 3, 4), (2, 2, 5)],  # right after a sync; mid-round; streaming
)
def test_kill_and_resume_is_bit_identical(tmp_path, fragments: int, H: int, stop: int) -> None:
    K, N, steps = 2, 2, 7
    full = run_threaded(K, train, N, H, steps, 0.7, 0.9, fragments)
    ckpt = str(tmp_path / "ckpt-{rank}.pt")
    run_threaded(K, train, N, H, steps, 0.7, 0.9, fragments, stop, None, ckpt)
    resumed = run_threaded(K, train, N, H, steps, 0.7, 0.9, fragments, None, ckpt)
    for r in range(K):
        a, b = full[r]["state"], resumed[r]["state"]
        assert a["inner_steps"] == b["inner_steps"] == steps
        assert a["fragment_syncs"] == b["fragment_syncs"]
        for key in ("module", "global", "momentum"):
            for n in a[key]:
                assert torch.equal(a[key][n], b[key][n]), f"rank {r} {key} {n}"
        sa, sb = a["inner_optimizer"]["state"], b["inner_optimizer"]["state"]
        assert sa.keys() == sb.keys()
        for i in sa:
            for k in sa[i]:
                assert torch.equal(sa[i][k], sb[i][k]), f"rank {r} optimizer state {i}.{k}"
        # snapshots after the resume point are the uninterrupted run's last ones
        tail = full[r]["snaps"][len(full[r]["snaps"]) - len(resumed[r]["snaps"]) :]
        for x, y in zip(tail, resumed[r]["snaps"]):
            assert all(torch.equal(x[n], y[n]) for n in x)


def test_checkpoint_of_another_rank_is_refused(tmp_path) -> None:
    ckpt = str(tmp_path / "c-{rank}.pt")
    run_threaded(2, train, 2, 2, 3, 0.7, 0.9, 1, 3, None, ckpt)

    def load_other(rank, group):
        net = sliced_net(2, rank)
        outer = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), sync_every=2, group=group)
        outer.load(str(tmp_path / f"c-{1 - rank}.pt"))

    out = run_threaded(2, load_other, raise_on_error=False)
    assert all(isinstance(e, DiLoCoError) and "rank=" in str(e) for e in out)


def test_non_identical_replicas_raise_clear_error() -> None:
    def body(rank, group):
        net = sliced_net(2, rank)
        if rank == 1:
            with torch.no_grad():  # a frozen slice on rank 1 only
                net.layers[0].down.frozen_weight_0.add_(1e-12)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        PartialDiLoCo(net, opt, sync_every=2, group=group)

    out = run_threaded(2, body, raise_on_error=False)
    for e in out:
        assert isinstance(e, DiLoCoError), e
        assert "not identical" in str(e) and "`layers.0.down.weight`" in str(e)
        assert "1 of" in str(e)


def test_single_process_world_and_plain_module() -> None:
    # no torch.distributed init: a world of one; an unsliced module trains every entry
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = PartialDiLoCo(net, opt, outer_lr=1.0, outer_momentum=0.0, sync_every=2)
    assert outer.world_size == 1 and all(torch.all(c == 1) for c in outer.counts.values())
    for s in (1, 2):
        x, y = batch(0, s)
        loss_fn(net(x), y).backward()
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        outer.step()
    # lr=1, mu=0, K=1: the new global parameters are exactly the local ones
    for n, p in net.named_parameters():
        torch.testing.assert_close(p, outer.global_parameters[n], rtol=0, atol=1e-15)
    assert not all(torch.equal(before[n], p) for n, p in net.named_parameters())


def test_mismatched_world_is_reported_not_hung() -> None:
    def body(rank, group):
        net = sliced_net(2, rank)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        outer = PartialDiLoCo(net, opt, sync_every=1, group=group, timeout_s=2)
        if rank == 0:  # rank 1 never syncs: rank 0's all-reduce must time out, not hang
            x, y = batch(rank, 1)
            loss_fn(net(x), y).backward()
            outer.step()

    out = run_threaded(2, body, raise_on_error=False, timeout_s=30)
    assert isinstance(out[0], DiLoCoError) and "same number of times" in str(out[0])
    assert "diloco.fragment0" in str(out[0])


def test_sync_communicates_one_full_copy_of_the_fragment() -> None:
    def body(rank, group):
        net = sliced_net(2, rank)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        outer = PartialDiLoCo(net, opt, sync_every=2, group=group, fragments=2)
        with CommCounter(group) as counter:
            for s in (1, 2):
                x, y = batch(rank, s)
                loss_fn(net(x), y).backward()
                outer.step()
        sizes = [sum(full_parameters(net)[n].numel() for n in f) for f in outer.fragments]
        return counter.bytes(label="diloco.fragment0"), counter.bytes(label="diloco.fragment1"), sizes

    for sent0, sent1, sizes in run_threaded(2, body):
        assert (sent0, sent1) == (8 * sizes[0], 8 * sizes[1])  # float64 deltas, sparse as dense
