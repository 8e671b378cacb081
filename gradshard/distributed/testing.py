"""Thread-backed gloo process groups for fast, hang-free distributed tests.

Spawned processes are slow to start; a gloo ``ProcessGroup`` per thread over a shared
``HashStore`` gives real gloo communication (loopback) inside one process. Code under test
must use the ``ProcessGroup`` object's own methods (``group.send([t], peer, tag)``,
``group.allreduce([t])``) or gradshard's ``comm`` helpers, which accept any group.

Example::

    def body(rank, group):
        t = torch.ones(2) * rank
        group.allreduce([t]).wait()
        return t

    results = run_threaded(2, body)      # [tensor([1., 1.]), tensor([1., 1.])]
"""

from __future__ import annotations

import datetime
import threading
from typing import Any, Callable

import torch
from torch.distributed import HashStore, PrefixStore

__all__ = ["make_gloo_group", "run_threaded", "ThreadedRunError"]


class ThreadedRunError(RuntimeError):
    """One or more ranks of a threaded run raised or did not finish in time."""


def make_gloo_group(store: Any, rank: int, world_size: int, timeout_s: float = 30.0):
    """A gloo ``ProcessGroup`` for ``rank`` of ``world_size`` over ``store`` (loopback)."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return ProcessGroupGloo(store, rank, world_size, opts)


def run_threaded(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 60.0,
    group_timeout_s: float = 20.0,
    raise_on_error: bool = True,
) -> list[Any]:
    """Run ``fn(rank, group, *args)`` on ``world_size`` threads, one gloo group each.

    Returns the per-rank results. A rank that raises, or a run that exceeds ``timeout_s``,
    raises :class:`ThreadedRunError` naming the ranks (with ``raise_on_error=False`` the
    exceptions are returned in place of results instead).
    """
    store = PrefixStore(f"gs-threaded-{id(fn)}-{threading.get_ident()}", HashStore())
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size
    torch_threads = torch.get_num_threads()

    def body(rank: int) -> None:
        torch.set_num_threads(max(1, torch_threads // world_size))
        try:
            group = make_gloo_group(store, rank, world_size, group_timeout_s)
            results[rank] = fn(rank, group, *args)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    for t in threads:
        remaining = (deadline - datetime.datetime.now()).total_seconds()
        t.join(max(0.0, remaining))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise ThreadedRunError(f"ranks {hung} did not finish within {timeout_s:.0f} s")
    if not raise_on_error:
        return [e if e is not None else r for r, e in zip(results, errors)]
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        lines = "\n".join(f"  rank {r}: {type(e).__name__}: {e}" for r, e in failed)
        raise ThreadedRunError(f"{len(failed)} rank(s) failed:\n{lines}") from failed[0][1]
    return results

