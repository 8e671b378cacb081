"""Gradient and loss reductions over a sequence-parallel group.

Loss convention. Under sequence parallelism each rank computes the loss of its own tokens,
and the global loss is the SUM of the per-rank losses. Each rank's parameter gradients are
then partial sums over its tokens, and the full-sequence gradient is their sum
(:func:`reduce_gradients`). A loss that is a *mean* over tokens must therefore divide each
rank's token sum by the GLOBAL token count, not the local one::

    local_sum = token_losses.sum()                               # this rank's tokens
    loss = global_mean(local_sum, token_losses.numel(), group)   # local_sum / N_global
    loss.backward()
    reduce_gradients(model.parameters(), group)                  # SUM over ranks

Dividing by the local count instead weights short slices more (slices may differ in length)
and scales the gradient by the world size.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.distributed import ReduceOp

from gradshard.runtime.comm import Communicator, communicator

__all__ = ["global_mean", "global_token_count", "reduce_gradients", "sum_over_group"]

GRAD_LABEL = "grad_allreduce"


def _comm(group: Any | None, comm: Communicator | None) -> Communicator:
    if comm is not None:
        return comm
    if group is None:
        raise ValueError("pass group= (a ProcessGroup) or comm= (a Communicator)")
    return communicator(group)


def global_token_count(
    num_local_tokens: int, group: Any | None = None, *, comm: Communicator | None = None
) -> int:
    """The number of tokens over all ranks of the group (one small all-reduce)."""
    c = _comm(group, comm)
    count = torch.tensor([int(num_local_tokens)], dtype=torch.int64)
    return int(c.all_reduce(count, label="token_count").item())


def global_mean(
    local_sum: torch.Tensor,
    num_local_tokens: int,
    group: Any | None = None,
    *,
    comm: Communicator | None = None,
) -> torch.Tensor:
    """``local_sum / N_global``: this rank's share of a mean-over-all-tokens loss."""
    return local_sum / global_token_count(num_local_tokens, group, comm=comm)


def sum_over_group(
    value: torch.Tensor, group: Any | None = None, *, comm: Communicator | None = None
) -> torch.Tensor:
    """The sum of a (detached) tensor over the group, e.g. the global loss for logging."""
    c = _comm(group, comm)
    out = value.detach().clone().contiguous()
    return c.all_reduce(out, label="sum_over_group")


def _check_same_parameters(c: Communicator, params: list[torch.nn.Parameter]) -> None:
    """All ranks must reduce the same parameters in the same order (else the sums mix)."""
    sig = torch.tensor([len(params), sum(p.numel() for p in params)], dtype=torch.int64)
    both = torch.cat([sig, -sig])
    c.all_reduce(both, label=f"{GRAD_LABEL}.check", op=ReduceOp.MAX)
    lo, hi = -both[2:], both[:2]
    if not torch.equal(lo, hi):
        raise RuntimeError(
            f"reduce_gradients on rank {c.rank}: ranks pass different parameter lists (this "
            f"rank: {sig[0].item()} parameters, {sig[1].item()} elements; over the group: "
            f"{lo.tolist()} .. {hi.tolist()}). Every rank must pass the same parameters in "
            f"the same order."
        )


def reduce_gradients(
    parameters: Iterable[torch.nn.Parameter],
    group: Any | None = None,
    *,
    comm: Communicator | None = None,
    reduce_grads: bool = True,
    bucket_bytes: int = 25 * 2**20,
) -> int:
    """SUM-all-reduce ``.grad`` of ``parameters`` over the group, in place, after backward.

    Parameters with ``requires_grad`` and no gradient on this rank get a zero gradient so
    that every rank sends the same buffers. Gradients are flattened into buckets of at most
    ``bucket_bytes`` per dtype/device. ``reduce_grads=False`` does nothing (each rank keeps
    its partial gradient). Returns the number of payload bytes reduced on this rank.
    """
    if not reduce_grads:
        return 0
    c = _comm(group, comm)
    params = [p for p in parameters if p.requires_grad]
    if c.world_size == 1:
        return 0
    _check_same_parameters(c, params)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            raise NotImplementedError("reduce_gradients does not handle sparse gradients")
    buckets: list[list[torch.Tensor]] = []
    keys: dict[tuple[torch.dtype, torch.device], int] = {}
    sizes: list[int] = []
    for p in params:
        g = p.grad
        key = (g.dtype, g.device)
        i = keys.get(key)
        nbytes = g.numel() * g.element_size()
        if i is None or (sizes[i] + nbytes > bucket_bytes and sizes[i] > 0):
            keys[key] = i = len(buckets)
            buckets.append([])
            sizes.append(0)
        buckets[i].append(g)
        sizes[i] += nbytes
    total = 0
    for grads in buckets:
        flat = torch.cat([g.reshape(-1) for g in grads])
        c.all_reduce(flat, label=GRAD_LABEL)
        total += flat.numel() * flat.element_size()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return total
