"""The sequence-parallel group a ``lasp`` compilation runs on, and its compile-time handshake.

``group`` (plan option) resolves to, in order: the given ``ProcessGroup`` (any object with
``rank()``, ``size()``, ``send``, ``recv``, ``allreduce``; ranks are group ranks, in sequence
order); the default world group when ``torch.distributed`` is initialised; otherwise a
single-rank :class:`SingleRankGroup` (world size 1: nothing is sent, the stages are still
listed), which is what ``gradshard show --plan lasp`` uses outside ``torchrun``.

Compiling is collective, in two steps run by the compile driver (never inside a pass):
before the passes, :func:`join_lasp_group` (the plan's ``prepare`` step) has every rank learn
every rank's local length (its slice is ``[start, start + T_local)`` of ``T_global``); after
compile, the ``gs_attach`` hook runs :func:`check_same_program`, so a rank whose graph
differs (number of LASP layers, state sizes, reduced parameters) fails at compile time
instead of mismatching messages later. Both are small all-reduces labelled ``lasp.compile``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed import ReduceOp

from gradshard.runtime.comm import Communicator
from gradshard.errors import GradshardError

__all__ = ["SingleRankGroup", "LaspGroup", "resolve_group", "exchange_lengths", "check_same_program"]

COMPILE_LABEL = "lasp.compile"


class SingleRankGroup:
    """A group of one rank (no communication): LASP without ``torch.distributed``."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def __repr__(self) -> str:
        return "SingleRankGroup()"


@dataclass(frozen=True)
class LaspGroup:
    """The resolved group, its communicator and this rank's place in the sequence."""

    group: Any
    comm: Communicator
    rank: int
    world_size: int
    start: int = 0  # first global step of this rank's slice
    local_len: int = 0
    seq_len: int = 0  # global sequence length
    lengths: tuple[int, ...] = ()

    @property
    def stop(self) -> int:
        return self.start + self.local_len

    @property
    def simulated(self) -> bool:
        return isinstance(self.group, SingleRankGroup)

    def describe(self) -> str:
        where = "single process (no torch.distributed group)" if self.simulated else f"group {self.group!r}"
        return (f"rank {self.rank} of {self.world_size} ({where}): steps [{self.start}, {self.stop}) of "
                f"{self.seq_len}")


def resolve_group(group: Any, timeout_s: float | None) -> LaspGroup:
    """Resolve the ``group`` option (see the module doc)."""
    if group is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        else:
            group = SingleRankGroup()
    for attr in ("rank", "size"):
        if not callable(getattr(group, attr, None)):
            raise GradshardError(
                f"plan 'lasp': option group={group!r} is not a process group (it has no {attr}()); "
                "pass a torch.distributed ProcessGroup (e.g. dist.new_group(ranks)) or leave it None "
                "to use the default world group"
            )
    comm = Communicator(group, timeout_s=timeout_s)
    return LaspGroup(group, comm, comm.rank, comm.world_size)


def exchange_lengths(g: LaspGroup, local_len: int) -> LaspGroup:
    """Learn every rank's local length: this rank's place in the global sequence."""
    if g.world_size == 1:
        return LaspGroup(g.group, g.comm, 0, 1, 0, local_len, local_len, (local_len,))
    lengths = torch.zeros(g.world_size, dtype=torch.int64)
    lengths[g.rank] = int(local_len)
    g.comm.all_reduce(lengths, label=COMPILE_LABEL)
    lens = tuple(int(x) for x in lengths.tolist())
    if min(lens) < 1:
        raise GradshardError(f"plan 'lasp': a rank holds no tokens (local lengths {lens}); every rank "
                             "needs a non-empty slice of the sequence")
    start = sum(lens[: g.rank])
    return LaspGroup(g.group, g.comm, g.rank, g.world_size, start, local_len, sum(lens), lens)


def check_same_program(g: LaspGroup, signature: Sequence[int]) -> None:
    """Fail on every rank unless all ranks compiled the same program (``signature``)."""
    if g.world_size == 1:
        return
    sig = torch.tensor([int(s) for s in signature], dtype=torch.int64)
    both = torch.cat([sig, -sig])
    g.comm.all_reduce(both, label=COMPILE_LABEL, op=ReduceOp.MAX)
    hi, lo = both[: len(sig)], -both[len(sig):]
    if not torch.equal(hi, lo):
        raise GradshardError(
            f"plan 'lasp' on rank {g.rank}: the ranks compiled different programs (this rank: "
            f"{sig.tolist()} = [LASP layers, state elements, reduced parameters, parameter elements, halos]; "
            f"over the group: {lo.tolist()} .. {hi.tolist()}). Every rank must compile the same model "
            "with inputs that differ only in their sequence slice."
        )
